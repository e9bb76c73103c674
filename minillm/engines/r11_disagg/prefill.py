"""The prefill worker: rung 3's engine that stops at the prompt (notebook 11).

It computes every prompt's K/V but its last token — the decode worker computes that one, and so
samples the first output token itself: one sampler, one commit point, rank 0's. A prefilled
request is *parked*: excluded from scheduling (``schedule(exclude=...)``, rung 7's seam) but
keeping its blocks and its seat, until rank 0 pulls its blocks and acknowledges them; then it ends
and its blocks go back to the pool — into the prefix cache, when caching is on.
"""
from __future__ import annotations

import sys

import torch

from ...core.engine import PagedEngine
from ...core.runner import reaching_end
from ...core.scheduler import Constraints, SchedulerOutput, SequenceGroup
from ...request import FinishReason, Request, RequestError, SamplingParams
from ...runtime.interface import StepOutput
from ...dist.comm import IDLE_TIMEOUT_S, Comm, WorkerError
from .transfer import Command, Handoff, Reply, filled_blocks, send_blocks


class PrefillEngine(PagedEngine):
    name = "prefill"
    supports_parallel = False

    def __init__(self, model, **options):
        super().__init__(model, **options)
        self.parked: dict[str, SequenceGroup] = {}

    def has_work(self) -> bool:
        parked = set(self.parked.values())
        return bool(self.scheduler.waiting) or any(g not in parked for g in self.scheduler.running)

    # --- the core's step, three phases overridden (core/engine.py) ------------------------------
    def schedule_step(self) -> SchedulerOutput:
        return self.scheduler.schedule(Constraints(exclude=set(self.parked.values())))

    def _idle(self, out: StepOutput) -> StepOutput:
        return out      # all parked: rank 0's pulls free blocks, not a livelock

    def execute(self, sched: SchedulerOutput) -> list[str]:
        """The forward without the head: K/V written, no logits. Returns the requests whose
        prompt this step finishes (found before the computed tokens are counted)."""
        self.runner.copy_blocks(sched.copies)
        ids, pos, meta, order, _ = self.runner.prepare(sched.scheduled)
        with torch.inference_mode():
            self.runner.forward(ids, pos, meta)
        return [order[k][0].request.request_id for k in reaching_end(order)]

    def finish_step(self, result: list[str], out: StepOutput) -> None:
        for rid in result:                  # parked until rank 0 pulls its blocks
            self.parked[rid] = self.groups[rid]

    def forget_aborted(self) -> None:
        """Requests aborted here are rank 0's to report: drop them from this worker's output."""
        self._take_aborted()

    def export(self, request_id: str) -> tuple[Handoff, list[torch.Tensor]]:
        """A parked request's blocks, as stored (it keeps them until ``release``)."""
        seq = self.parked[request_id].seqs[0]
        n = seq.num_computed_tokens
        blocks = filled_blocks(seq.block_table, n, self.block_size)
        hashes = tuple(self.block_manager.blocks[b].hash for b in blocks)
        return (Handoff(request_id, n, len(blocks), hashes),
                self.runner.pool.read_blocks(blocks))

    def release(self, request_id: str) -> None:
        """The transfer landed: end the request here (its blocks freed, or kept cached)."""
        group = self.parked.pop(request_id, None)
        if group is not None:
            self.scheduler.finish_group(group, FinishReason.LENGTH)

    def abort(self, request_id: str) -> bool:
        self.parked.pop(request_id, None)
        return super().abort(request_id)


def serve(comm: Comm, engine: PrefillEngine) -> None:
    """The prefill worker's loop: a command from rank 0, the reply (and the pulled blocks) at
    once, then one prefill step, whose newly parked requests the next reply reports. Replying
    before the step means a pull never waits for a prefill step to end; and after a reply that
    reports newly prefilled requests the worker waits for the next command before it steps
    again — that command is the one that can pull them, and rank 0 sends it within one decode
    step, where a prefill step would keep the first token waiting for a whole step."""
    parked: list[str] = []                  # newly prefilled since the last reply
    while True:
        cmd: Command | str = comm.recv_object(0, what=None, timeout_s=IDLE_TIMEOUT_S)
        if cmd == "stop":
            comm.flush()
            return
        for rid in cmd.acks:
            engine.release(rid)
        for rid, ids, priority in cmd.new:
            # rank 0 checked it against this pool (the handshake's num_blocks): it fits
            engine.add_request(Request(ids, SamplingParams(max_tokens=1), request_id=rid,
                                       priority=priority))
        for rid in cmd.aborts:        # after the new ones: a prompt may be aborted as it arrives
            engine.abort(rid)
        engine.forget_aborted()
        sent = [engine.export(rid) for rid in cmd.pulls]
        allocator = engine.block_manager
        ready = [(rid, engine.parked[rid].seqs[0].num_computed_tokens) for rid in parked
                 if rid in engine.parked]
        comm.send_object(Reply(ready, [h for h, _ in sent], allocator.num_free_blocks,
                               allocator.num_blocks, engine.snapshot() if cmd.snapshot else None), 0)
        for _, data in sent:
            send_blocks(comm, 0, data)
        comm.prune()
        before = set(engine.parked)
        if engine.has_work() and not ready:
            engine.step()
        parked = [rid for rid in engine.parked if rid not in before]


def run_prefill_worker(comm: Comm, model) -> None:
    """Rank 1: build the prefill engine from the options rank 0 sends, say how big its pool is,
    serve."""
    options = comm.recv_object(0, what=None)
    try:
        engine = PrefillEngine(model, **options)
    except (ValueError, RequestError) as e:
        comm.send_object(("error", str(e)), 0)
        comm.flush()
        print(f"[minillm prefill] {e}", file=sys.stderr)
        return
    comm.send_object(("ready", engine.block_manager.num_blocks), 0)
    try:
        serve(comm, engine)
    except WorkerError as e:
        print(f"[minillm prefill] {e}", file=sys.stderr)
        raise
