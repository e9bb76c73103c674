"""The paged allocator of the fragmentation visualizer: the real ``PagedEngine``, computing nothing.

``PagedReplay`` is ``PagedEngine`` with its real scheduler, block manager and postprocess, given a
model runner that computes nothing (``NullRunner``) and a sampler that replays each sample's
tokens (``ReplaySampler``). Blocks of ``block_size`` slots are taken only when the last one is
full and can sit anywhere in the pool. Nothing here repeats what the engine does, so a replay
cannot drift from it: a trace of a real run (``traces.py``) replays to the engine's own numbers.
Run through ``allocators.simulate``; used by notebook 05 (``05_fragmentation_visualizer``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..engines.s3_paged.runner import reaching_end, step_order
from ..engines.s3_paged.sequence import Sequence
from ..memory import MemorySnapshot
from ..engines.s3_paged.beam import BeamChoice
from ..request import Request, RequestError, SamplingParams
from .accounting import ALLOCATOR_LABELS, SimConfig, SimStep
from ..workload import SimRequest


REPLAY_EOS = -2       # the replay "model"'s end-of-sequence token: ends each sample where it ended


@dataclass
class ReplayModel:
    """What the engine reads off a model, for replays that run none."""

    max_model_len: int
    kv_bytes_per_token: int
    eos_token_ids: set[int] = field(default_factory=lambda: {REPLAY_EOS})
    tokenizer: object = None
    device: torch.device = torch.device("cpu")
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(vocab_size=1 << 31))


class NullRunner:
    """A model runner that computes nothing: a scheduled token's K/V count as written at once.
    Which sequences reach their newest token, and in what order, is decided exactly as in
    ``ModelRunner.run``, so forks and frees happen in the engine's own order."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], None]:
        order = step_order(scheduled)
        return [order[k][0] for k in reaching_end(order)], None


class ReplaySampler:
    """Emits the tokens each sample produced (recorded ones for a trace, ``DUMMY_TOKEN`` for a
    synthetic workload), and ends each sample after as many tokens as it had."""

    def __init__(self, requests: dict[str, SimRequest]):
        self.requests = requests

    def __call__(self, logits, rows: list[tuple[int, Sequence]]):
        tokens, beams = [], []
        for _, seq in rows:
            r, k = self.requests[seq.request.request_id], len(seq.output_token_ids)
            if r.beam_width > 1:      # no scores needed: ``replay_beams`` knows the choice
                beams.append((seq, torch.zeros(1)))
                continue
            last = k + 1 >= r.output_lens[seq.sample_id]
            tokens.append((seq, REPLAY_EOS if last else r.token(seq.sample_id, k)))
        return tokens, beams


class ReplayBeams:
    """Beam search's choice at each step, as the recorded run made it (``BeamChoice``)."""

    def __init__(self, requests: dict[str, SimRequest]):
        self.requests = requests

    def __call__(self, group, eos_ids, max_model_len) -> BeamChoice:
        recorded = self.requests[group.request.request_id].beam_choices
        return BeamChoice.from_list(recorded[len(group.request.beam_choices)])


class PagedReplay:
    """The paged allocator *is* the paged engine: ``PagedEngine`` with its real scheduler, block
    manager and postprocess, given ``NullRunner``, ``ReplaySampler`` and ``ReplayBeams``. Nothing here repeats what
    the engine does, so a replay cannot drift from it."""

    name = "paged"

    def __init__(self, cfg: SimConfig):
        from ..engines.s3_paged.engine import PagedEngine
        self.cfg = cfg
        self.requests: dict[str, SimRequest] = {}
        self.engine = PagedEngine(
            ReplayModel(cfg.max_model_len, cfg.bytes_per_slot), block_size=cfg.block_size,
            num_blocks=cfg.num_blocks, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.enable_prefix_caching,
            policy=cfg.policy, runner=NullRunner(), sampler=ReplaySampler(self.requests))
        self.bm, self.scheduler = self.engine.block_manager, self.engine.scheduler
        self.scheduler.select_beams = ReplayBeams(self.requests)
        self.num_finished = 0

    @staticmethod
    def _request(r: SimRequest) -> Request:
        params = SamplingParams(max_tokens=r.max_tokens, n=r.n, beam_width=r.beam_width)
        return Request(list(r.prompt_token_ids), params, request_id=r.request_id,
                       priority=r.priority)

    def fits(self, r: SimRequest) -> bool:
        """Whether the engine would accept the request (``PagedEngine.validate``)."""
        try:
            self.engine.validate(self._request(r))
        except RequestError:
            return False
        return True

    def add(self, r: SimRequest) -> None:
        self.requests[r.request_id] = r
        self.engine.add_request(self._request(r))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> None:
        self.num_finished += len(self.engine.step().finished)

    def measure(self, step: int) -> tuple[SimStep, MemorySnapshot | None]:
        live = self.scheduler.live_seqs()
        st = self.bm.stats(live)
        bs = self.cfg.block_size
        rec = SimStep(step, st.allocated_slots, st.token_slots, st.allocated_slots - st.token_slots,
                      0, 0, st.free * bs, st.cached * bs, len(self.scheduler.running),
                      len(self.scheduler.waiting), self.num_finished,
                      self.scheduler.num_preemptions, self.bm.prefix_hits)
        snap = None
        if self.cfg.keep_snapshots:
            snap = self.bm.snapshot(live, ALLOCATOR_LABELS["paged"], step, self.cfg.bytes_per_slot)
        return rec, snap
