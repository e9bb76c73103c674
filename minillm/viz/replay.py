"""Replay a workload through the real engine under each KV allocator, computing nothing (notebook 05).

Memory waste in a KV cache depends only on *who holds which slots when*, not on what the model
computes. So the visualizer runs the real ``PagedEngine`` — its scheduler, its commit point, the
allocator of ``minillm.engines.r5_allocators`` it is given — with a model runner that does no math
(``NullRunner``: a scheduled token's K/V count as written at once) and a sampler that replays
each sample's tokens (``ReplaySampler``: recorded ones for a trace of a real run, ``DUMMY_TOKEN``
for a synthetic workload). Hundreds of steps take a fraction of a second, which is what lets
notebook 05 re-run everything whenever a slider moves. Nothing here repeats what the engine does,
so a replay cannot drift from it: a trace of a real run (``traces.py``) replays to the engine's own
numbers, and the three allocators differ in memory only.

``simulate`` serves a workload under one allocator, ``compare`` under all of them at one budget.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..runtime.driver import Driver, ScheduledArrivals, StepClock
from ..engines.r5_allocators import ALLOCATORS, make_allocator
from ..engines.r5_allocators.null import REPLAY_EOS, NullRunner, ReplayModel  # noqa: F401
from ..core.beam import BeamChoice
from ..engines import engine_kwargs
from ..core.engine import PagedEngine
from ..core.sequence import Sequence
from ..memory import MemorySnapshot
from ..request import Request, SamplingParams
from ..workload import SimRequest
from .accounting import ALLOCATOR_LABELS, SimConfig, SimResult

class ReplaySampler:
    """Emits the tokens each sample produced and ends it after as many tokens as it had."""

    def __init__(self, requests: dict[str, SimRequest]):
        self.requests = requests

    def __call__(self, logits, rows: list[tuple[int, Sequence]]):
        tokens, beams = [], []
        for _, seq in rows:
            r, k = self.requests[seq.request.request_id], len(seq.output_token_ids)
            if r.beam_width > 1:      # no scores needed: ``ReplayBeams`` knows the choice
                beams.append((seq, torch.zeros(1)))
                continue
            last = k + 1 >= r.output_lens[seq.sample_id]
            tokens.append((seq, REPLAY_EOS if last else r.token(seq.sample_id, k)))
        return tokens, beams


class ReplayBeams:
    """Beam search's choice at each step, as the recorded run made it (``BeamChoice``)."""

    def __init__(self, requests: dict[str, SimRequest]):
        self.requests = requests
        self.made: dict[str, int] = {}         # request id -> choices replayed so far

    def __call__(self, group, eos_ids, max_model_len) -> BeamChoice:
        rid = group.request.request_id
        i = self.made[rid] = self.made.get(rid, -1) + 1
        return BeamChoice.from_list(self.requests[rid].beam_choices[i])


def replay_engine(cfg: SimConfig, allocator: str, requests: dict[str, SimRequest]) -> PagedEngine:
    """The real engine under ``allocator``, computing nothing; ``requests`` (filled as they are
    added) says what each one produced."""
    max_len = cfg.max_len or max((r.prompt_len + r.max_tokens for r in requests.values()), default=1)
    alloc = make_allocator(allocator, cfg.budget_slots, cfg.block_size, max_len,
                           cfg.enable_prefix_caching, cfg.wrap, cfg.max_model_len)
    engine = PagedEngine(
        ReplayModel(cfg.max_model_len, cfg.bytes_per_slot), block_size=cfg.block_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        **engine_kwargs({"policy": cfg.policy, **cfg.policy_options}), runner=NullRunner(),
        sampler=ReplaySampler(requests),
        block_manager=alloc, select_beams=ReplayBeams(requests))
    return engine


def as_request(r: SimRequest) -> Request:
    params = SamplingParams(max_tokens=r.max_tokens, n=r.n, beam_width=r.beam_width)
    return Request(list(r.prompt_token_ids), params, request_id=r.request_id, priority=r.priority)


def simulate(requests: list[SimRequest], allocator: str = "paged", config: SimConfig | None = None,
             max_steps: int = 100_000) -> SimResult:
    """Serve ``requests`` under ``allocator``; one ``StepRecord`` (and snapshot) per engine step.

    The one driver (``core.driver``) on a clock of steps: before each step, every request whose
    ``arrival_step`` has come is added (in list order among equals); one the engine would reject
    (it could never fit the memory alone) is rejected. With ``config.idle_steps`` an empty system
    still ticks (synthetic timelines where arrival steps are clock time); without it, like the
    engine, it jumps to the next arrival without recording a step.
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}: choose one of {', '.join(ALLOCATORS)}")
    cfg = config or SimConfig()
    sims = {r.request_id: r for r in requests}
    engine = replay_engine(cfg, allocator, sims)
    snaps, rejected = [], []
    driver = Driver(engine, StepClock("tick" if cfg.idle_steps else "jump"),
                    ScheduledArrivals([(r.arrival_step, as_request(r)) for r in requests]),
                    validate=cfg.validate or allocator != "paged",   # a trace's paged run took all
                    on_reject=lambda req, e: rejected.append(req.request_id),
                    on_step=(lambda out, rec: snaps.append(titled(engine.snapshot(), allocator)))
                    if cfg.keep_snapshots else None,
                    max_steps=max_steps)
    steps = driver.run().steps
    return SimResult(allocator, cfg, steps, snaps, len(requests), rejected)


def titled(snap: MemorySnapshot, allocator: str) -> MemorySnapshot:
    """A replay's snapshot, titled by its allocator (the engine is the paged one under each)."""
    return dataclasses.replace(snap, engine=ALLOCATOR_LABELS[allocator])


def compare(requests: list[SimRequest], config: SimConfig | None = None,
            allocators: tuple[str, ...] = ALLOCATORS) -> dict[str, SimResult]:
    """The same workload under every allocator at the same memory budget."""
    return {a: simulate(requests, a, config) for a in allocators}
