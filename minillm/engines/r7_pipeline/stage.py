"""One pipeline stage: a contiguous slice of the layers and the KV pools of those layers only
(notebook 07).

Rank 0 also embeds the tokens (and schedules, in ``engine.py``); the last rank also applies the
final norm and the head, and sends the logits of the rows to sample back to rank 0, which samples
with the same ``Sampler`` as the single-process engine (so the tokens are exactly its tokens).
Every rank receives the same ``StepInputs`` for a micro-batch — positions, slot_mapping, block
tables, copy-on-write copies — so every rank writes its layers' K/V into the same slots.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from ...layers.attention.reference import AttentionMetadata
from ...layers.kv_quant import get_format
from ...core.model import PagedLlama
from ...core.runner import ModelRunner, reaching_end
from ...core.sequence import Sequence
from ...dist.comm import IDLE_TIMEOUT_S, Comm
from .timeline import Event

# A test hook: "RANK:STEPS" makes worker RANK exit abruptly (os._exit(3)) after STEPS micro-batches.
EXIT_HOOK_ENV = "MINILLM_PIPELINE_TEST_EXIT"


def split_layers(num_layers: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's layers, as even as possible, earlier ranks taking the extra
    ones. With more ranks than layers the last ranks hold none: they still pass hidden states on
    (and the last one applies the head), which is what 3 stages of the 2-layer tiny model do."""
    base, extra = divmod(num_layers, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass(frozen=True)
class StageConfig:
    """What rank 0 tells every worker once, right after the group forms."""

    world_size: int
    num_blocks: int
    block_size: int
    attention_backend: str | None
    kv_cache_dtype: str = "auto"         # how every stage stores its K/V (rung 9)


@dataclass
class StepInputs:
    """One micro-batch, as every rank needs it (rank 0 sends it to each worker)."""

    microbatch: int
    num_tokens: int
    positions: torch.Tensor
    meta: AttentionMetadata
    copies: list[tuple[int, int]]        # copy-on-write block copies to do before the forward
    logit_rows: list[int]                # flat token indices whose logits the sampler needs

    # Pickled as numpy arrays: pickling a torch tensor goes through its storage and costs ~1 ms
    # each way (measured), more than a small model's whole forward on one stage.
    def __getstate__(self) -> dict:
        meta = {f.name: _np(getattr(self.meta, f.name)) for f in dataclasses.fields(self.meta)}
        return {**self.__dict__, "positions": _np(self.positions), "meta": meta}

    def __setstate__(self, state: dict) -> None:
        meta = {k: _torch(v) for k, v in state.pop("meta").items()}
        self.__dict__.update(state, positions=_torch(state["positions"]),
                             meta=AttentionMetadata(**meta))

    def to(self, device: torch.device) -> "StepInputs":
        moved = {f.name: getattr(self.meta, f.name).to(device)
                 for f in dataclasses.fields(self.meta)
                 if isinstance(getattr(self.meta, f.name), torch.Tensor)}
        return dataclasses.replace(self, positions=self.positions.to(device),
                                   meta=dataclasses.replace(self.meta, **moved))


def _np(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else x


def _torch(x):
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


class StageRunner(ModelRunner):
    """A ``ModelRunner`` for this rank's layers [start, end): built through the same
    ``ModelRunner.__init__`` (its ``KVPool`` holds those layers only), with the single-process
    ``prepare``, ``slot_mapping``, ``copy_blocks`` and ``forward``; only the head is the last
    rank's."""

    def __init__(self, net: PagedLlama, rank: int, config: StageConfig, backend, device, dtype):
        self.rank, self.world_size, self.config = rank, config.world_size, config
        start, end = split_layers(len(net.layers), self.num_stages)[self.stage]
        super().__init__(None, config.num_blocks, config.block_size, backend, net=net,
                         layers=range(start, end), device=device, dtype=dtype,
                         kv_format=get_format(config.kv_cache_dtype))
        self.hidden_size = net.embed.shape[1]

    # --- where this rank sits: one rank per stage here; rung 10 (r10_tensor) makes a stage of
    # T ranks by overriding these and the two messages below.
    @property
    def stage(self) -> int:
        return self.rank

    @property
    def num_stages(self) -> int:
        return self.world_size

    @property
    def logits_rank(self) -> int:
        """The rank that computes the logits and sends them to rank 0."""
        return self.world_size - 1

    @property
    def start(self) -> int:
        return self.layers.start

    @property
    def end(self) -> int:
        return self.layers.stop

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def receive_input(self, comm: Comm, inputs: "StepInputs") -> torch.Tensor:
        """A worker's input for a micro-batch: the previous stage's hidden states."""
        return comm.recv((inputs.num_tokens, self.hidden_size), self.dtype, comm.rank - 1,
                         microbatch=inputs.microbatch)

    def send_input(self, comm: Comm, ids: torch.Tensor, microbatch: int) -> None:
        """What rank 0 sends of a micro-batch's token ids before computing it: nothing here (it
        alone embeds them)."""

    def send_output(self, comm: Comm, out: torch.Tensor) -> None:
        """Hidden states on to the next stage; the last stage's logits back to rank 0."""
        if not self.is_last:
            comm.isend(out, comm.rank + 1)
        elif out.shape[0] and comm.rank != 0:
            comm.isend(out, 0)

    def prepare_step(self, scheduled: list[tuple[Sequence, int]], copies: list[tuple[int, int]],
                     microbatch: int) -> tuple[torch.Tensor, StepInputs, list[Sequence]]:
        """(input ids, what every rank needs, the sequences whose logits will come back)."""
        ids, pos, meta, order, last = self.prepare(scheduled)
        want = reaching_end(order)
        inputs = StepInputs(microbatch, len(ids), pos, meta, list(copies), [last[k] for k in want])
        return ids, inputs, [order[k][0] for k in want]

    @property
    def computes_logits(self) -> bool:
        return self.rank == self.logits_rank

    @torch.inference_mode()
    def compute(self, inputs: StepInputs, x: torch.Tensor) -> torch.Tensor:
        """Token ids (rank 0) or hidden states in -> hidden states out, or, on the last rank,
        the logits of ``inputs.logit_rows``."""
        self.copy_blocks(inputs.copies)
        h = self.forward(x, inputs.positions, inputs.meta)   # rank 0 (layers from 0) embeds
        if not self.computes_logits:
            return h
        if not inputs.logit_rows:
            return h.new_empty((0, self.net.vocab_size), dtype=torch.float32)
        # Norm every row, then pick, exactly as PagedLlama.forward + ModelRunner.run do.
        idx = torch.tensor(inputs.logit_rows, device=self.device)
        return self.net.logits(self.net.final_hidden(h)[idx])


def serve(comm: Comm, runner: StageRunner) -> None:
    """A worker's loop (ranks 1..P-1): metadata from rank 0, hidden states from the rank before,
    compute, pass on. Control messages: "stop", "clear" (the timeline), "timeline" (send it)."""
    exit_rank, _, exit_after = os.environ.get(EXIT_HOOK_ENV, "").partition(":")
    exit_after = int(exit_after) if exit_rank == str(comm.rank) else -1
    timeline, steps = comm.timeline, 0
    while True:
        t = time.time()
        msg = comm.recv_object(0, what=None, timeout_s=IDLE_TIMEOUT_S)
        if msg == "stop":
            comm.flush()
            return
        if msg == "clear":
            timeline.clear()
            continue
        if msg == "timeline":
            comm.send_object(list(timeline.events), 0)
            continue
        inputs: StepInputs = msg.to(comm.device)
        mb = inputs.microbatch
        timeline.events.append(Event(comm.rank, "recv", t, time.time(), mb))
        x = runner.receive_input(comm, inputs)
        with timeline.span("compute", mb):
            out = runner.compute(inputs, x)
        runner.send_output(comm, out)
        comm.prune()
        steps += 1
        if steps == exit_after:
            os._exit(3)
