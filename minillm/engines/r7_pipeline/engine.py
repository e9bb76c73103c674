"""Rung 7 — pipeline parallelism with dynamic batching, on torch.distributed (notebook 07).

The model's layers are cut into P contiguous slices, one per process (rank). Rank 0 embeds the
tokens and runs the first slice, each next rank the next slice, and the last rank applies the
head; hidden states travel rank to rank by point-to-point messages (gloo on CPU, NCCL on CUDA).

With one batch at a time, each rank would work 1/P of the time and wait the rest (the pipeline's
*bubbles*). So rank 0 keeps up to ``num_microbatches`` micro-batches in flight: while rank 1
computes micro-batch 3, rank 0 already computes micro-batch 4. Continuous batching works across
them: each micro-batch is an ordinary scheduler step over the requests that are *not* in flight
(a request's next token depends on its previous one, so it can be in one micro-batch at a time);
a new request joins whichever micro-batch is formed next, a finished one leaves when its tokens
come back. Rank 0 owns the one ``Scheduler`` and ``BlockManager`` (rung 3's, unchanged); every
rank applies the block tables and slot mappings rank 0 sends it, so the KV pools stay in step.

Exactness: the logits of the rows to sample come back to rank 0, which samples them with rung 3's
``Sampler`` and commits them with the scheduler's ``update_from_output``: with one micro-batch in flight
this engine makes exactly the single-process engine's steps, so its tokens are that engine's
tokens (n > 1, beams, preemption and prefix caching included).

Pipelining adds throughput, not latency: a request still passes through every layer in turn,
plus a message per stage; what grows is how many tokens are computed per second overall.
"""
from __future__ import annotations

import time
import weakref
import torch

from ...runtime.interface import StepOutput
from ...core.engine import PagedEngine
from ...core.model import PagedLlama
from ...core.executor import LaunchedStep
from ...core.scheduler import Constraints, SchedulerOutput
from ...core.sequence import Sequence
from ...dist.comm import WorkerError, deferred_interrupt
from .config import ParallelConfig
from ...dist.launcher import WorkerGroup, launch, torchrun_group, under_torchrun
from .launcher import run_worker
from .stage import StageConfig, StageRunner, split_layers
from .timeline import Event, format_summary


class RankExecutor:
    """Micro-batches through the ranks: up to ``depth`` in flight, nothing launched ahead. The
    forward itself is the engine's (``launch``/``wait``: rank 0 computes its stage and sends it
    on; the last rank's logits come back), so this only says how many; rank 0 alone decides,
    so it may change between runs (``measure.py`` does)."""

    def __init__(self, depth: int = 2):     # (a pipeline has >= 2 stages until connected)
        self.depth, self.ahead = depth, 0

    def submit(self, fn, *args):
        return fn(*args)

    def wait(self, handle):
        return handle

    def call(self, fn, *args):
        return fn(*args)

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {"num_microbatches": self.depth}


class PipelineEngine(PagedEngine):
    name = "pipeline"
    refuses = frozenset({"prompt_logprobs"})   # the last stage returns sampled rows' logits only
    configs = PagedEngine.configs + (ParallelConfig,)

    def __init__(self, model, *, group: WorkerGroup | None = None, **options):
        """``options``: the paged engine's and ``ParallelConfig``'s, flat. Ranks:
        ``pipeline_parallel_size`` (>= 2); up to ``num_microbatches`` in flight (default: one per
        rank). Without ``group``, ranks 1.. are spawned on this machine (CPU, gloo), each with
        ``worker_threads`` torch threads; under torchrun (RANK, WORLD_SIZE... set) this process
        joins torchrun's ranks instead (threads: OMP_NUM_THREADS, which torchrun sets).
        ``pipeline_timeout_s`` bounds every wait: a silent peer becomes an error, not a hang."""
        torchrun = group is None and under_torchrun()   # one process per rank, from torchrun
        if group is None and not torchrun and model.device.type != "cpu":
            raise ValueError("spawning pipeline workers works on one CPU machine; on GPUs start "
                             "one process per GPU with torchrun (see docs/rungs/07_pipeline.md)")
        # PagedEngine checks every option, then builds rank 0's stage (``make_runner``), all
        # before any process is started.
        super().__init__(model, executor=RankExecutor(), **options)
        parallel = self.parallel_config
        world, timeout = self.world_size, parallel.pipeline_timeout_s
        if torchrun:
            group = torchrun_group(timeout, model.device)
        self.group = group or self.launch_workers(world, timeout, parallel.worker_threads)
        self.comm = self.group.comm
        self._finalizer = weakref.finalize(self, self.group.close)   # workers never outlive us
        if self.comm.world_size != world:
            self.close()
            raise ValueError(f"{self.world_size_name} but the process group has "
                             f"{self.comm.world_size} ranks")
        try:
            self.connect()
        except WorkerError as e:
            raise self.group.failure(e) from None
        self.num_microbatches = parallel.num_microbatches or self.runner.num_stages
        self.broken: WorkerError | None = None

    @property
    def num_microbatches(self) -> int:
        """Micro-batches in flight at most: the executor's depth."""
        return self.executor.depth

    @num_microbatches.setter
    def num_microbatches(self, n: int) -> None:
        self.executor.depth = n

    # --- the ranks: one per stage (rung 10 overrides these four for stages of T ranks) -------------
    @property
    def world_size(self) -> int:
        return self.parallel_config.pipeline_parallel_size

    @property
    def world_size_name(self) -> str:
        return f"pipeline_parallel_size={self.world_size}"

    def launch_workers(self, world: int, timeout_s: float, threads: int) -> WorkerGroup:
        return launch(self.runner.net, world, timeout_s, threads, run_worker, role="pipeline")

    def connect(self) -> None:
        """Once the group has formed: tell every worker its stage's layout."""
        for rank in range(1, self.world_size):
            self.comm.send_object(self.runner.config, rank)

    def kv_bytes_per_rank(self) -> list[int]:
        """Bytes of KV cache each rank holds per token: its stage's layers' share."""
        layers = len(self.runner.net.layers)
        per_layer = self.kv_bytes_per_token // layers
        return [per_layer * (end - start) for start, end in split_layers(layers, self.world_size)]

    def make_runner(self, num_blocks: int, block_size: int, backend) -> StageRunner:
        """Rank 0's stage (the first slice of the layers and their KV pool). The workers build
        theirs from the same ``StageConfig`` (``runner.config``), which ``connect`` sends them."""
        config = StageConfig(self.parallel_config.pipeline_parallel_size, num_blocks, block_size,
                             self.model_config.attention_backend, self.cache_config.kv_cache_dtype)
        net = PagedLlama(self.model.hf_model, self.linear_kernel(), self.layer_ops())
        return StageRunner(net, 0, config, backend, self.model.device, self.model.dtype)

    # --- one step: the core's loop; a launch goes through the ranks ---------------------------------
    def schedule_step(self) -> SchedulerOutput:
        """A scheduler step over the running requests not in flight: those are excluded (neither
        scheduled nor preempted, though they keep their seats against ``max_num_seqs``). New
        requests are admitted up to an even share of the requests in the engine: otherwise the
        first micro-batch would take them all and leave the others empty (and the pipeline would
        run one micro-batch at a time). With one micro-batch the share is everything: exactly
        rung 3's schedule."""
        if self.broken is not None:
            raise self.broken
        busy = {g for step in self.in_flight for g in step.groups}
        share = -(-len(self.groups) // self.num_microbatches)
        visible = sum(1 for g in self.scheduler.running if g not in busy)
        with self.comm.timeline.span("schedule", self.num_launched):
            return self.scheduler.schedule(Constraints(busy, max_new=max(0, share - visible)))

    def launch(self, step: LaunchedStep) -> None:
        """The first half of rung 3's ``execute``, for the next micro-batch: prepare its inputs,
        commit them as computed (the next micro-batch's schedule must see its tokens so), run the
        first stage and send it on."""
        index, timeline, sched = step.index, self.comm.timeline, step.sched
        with timeline.span("schedule", index):
            ids, inputs, reached = self.runner.prepare_step(sched.scheduled, sched.copies, index)
            self.scheduler.update_after_forward(sched)
            step.committed = True
        t = time.perf_counter()
        # Every rank must see all of a micro-batch or none of it, and rank 0 must know it is in
        # flight: Ctrl-C waits until all that is done. The metadata goes out first (the sends
        # finish in the background) so that no rank waits for it longer than for its input.
        try:
            with deferred_interrupt():
                with timeline.span("send", index):
                    for rank in range(1, self.comm.world_size):
                        self.comm.send_object(inputs, rank)
                    self.runner.send_input(self.comm, ids, index)
                with timeline.span("compute", index):
                    out = self.runner.compute(inputs, ids)
                if not self.runner.computes_logits:
                    self.runner.send_output(self.comm, out)
                # set while Ctrl-C is held: a micro-batch that went out is waited for by a reset
                step.handle = (reached, out if self.runner.computes_logits else None, t)
        except WorkerError as e:
            raise self._break(e) from None
        self.comm.prune()

    def wait(self, step: LaunchedStep) -> tuple:
        """The second half of ``execute``: the logits of the micro-batch's rows, back from the
        last rank (or computed by rank 0 itself: rung 10 with one stage), and its time through
        the whole pipeline, launch to logits back."""
        if step.result is not None:
            return step.result
        reached, logits, t = step.handle
        try:
            with deferred_interrupt():   # the logits received <=> kept on the step
                if logits is None and not reached:
                    logits = torch.empty((0, self.runner.net.vocab_size))
                elif logits is None:
                    logits = self.comm.recv((len(reached), self.runner.net.vocab_size),
                                            torch.float32, self.runner.logits_rank,
                                            microbatch=step.index)
                step.result = ((reached, logits), (time.perf_counter() - t) * 1000.0)
        except WorkerError as e:
            raise self._break(e) from None
        return step.result

    def land(self, step: LaunchedStep, out: StepOutput) -> None:
        """Rung 3's: sample and commit, once the logits are in (rank 0's host work, timed so)."""
        self.wait(step)
        with self.comm.timeline.span("schedule", step.index):
            super().land(step, out)

    def _break(self, error: WorkerError) -> WorkerError:
        self.broken = self.broken or self.group.failure(error)
        return self.broken

    def finish_step(self, result, out: StepOutput) -> None:
        """Rung 3's, less the rows of requests aborted while their micro-batch was in flight
        (they are gone: their rows are dropped)."""
        reached, logits = result
        keep = [i for i, s in enumerate(reached) if self._alive(s)]
        if len(keep) != len(reached):
            logits = logits[keep]
        super().finish_step(([reached[i] for i in keep], logits), out)

    def record(self, *args, **kwargs):
        """Rung 3's per-step record (memory counts...): rank 0's host work, timed as such."""
        with self.comm.timeline.span("schedule"):
            return super().record(*args, **kwargs)

    def _alive(self, seq: Sequence) -> bool:
        group = self.groups.get(seq.request.request_id)
        return group is not None and seq in group.seqs

    def health_error(self) -> str | None:
        """The error that broke the pipeline, or a worker seen dead while idle (the next step
        would fail on it): either way this engine never serves again."""
        if self.broken is not None:
            return str(self.broken)
        return self.group.dead_worker()

    # --- clean-up, timeline ---------------------------------------------------------------------
    def reset(self):
        """Drop every request; micro-batches in flight are received first (their results
        discarded: the core's ``_drain``) so that every rank is between micro-batches again."""
        if self.broken is not None:
            self.in_flight.clear()
        return super().reset()

    def close(self) -> None:
        """Stop the workers (also done when the engine is garbage-collected)."""
        self._finalizer()
        self.broken = self.broken or WorkerError("this pipeline engine is closed: its workers "
                                                   "are stopped")

    def _workers(self):
        if self.broken is not None:
            raise self.broken
        if self.in_flight:
            raise RuntimeError("the timeline is exchanged between runs, not with micro-batches "
                               "in flight")
        return range(1, self.comm.world_size)

    def clear_timeline(self) -> None:
        for rank in self._workers():
            self.comm.send_object("clear", rank)
        self.comm.timeline.clear()

    def timeline(self) -> list[Event]:
        """Every rank's events since the last ``clear_timeline`` (``timeline.py`` sums them up
        and draws them)."""
        events = list(self.comm.timeline.events)
        try:
            for rank in self._workers():
                self.comm.send_object("timeline", rank)
                events += self.comm.recv_object(rank, what=None)
        except WorkerError as e:
            self.broken = self.group.failure(e)
            raise self.broken from None
        return sorted(events, key=lambda e: (e.rank, e.start))

    def timeline_summary(self) -> str:
        return format_summary(self.timeline())
