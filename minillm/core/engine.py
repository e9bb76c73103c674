"""Rung 3 — the paged engine: block manager + scheduler + our own forward (notebook 03).

One step, data flowing one way, in the one step loop every paged rung runs (``_step``)::

    launch:  propose -> Scheduler.schedule (tokens within the budget, KV slots reserved)
             -> executor.submit(execute): copy-on-write copies, one forward over the batch
    land:    wait -> record the step's time -> update_after_forward (K/V counted, samples
             forked) -> Sampler (a token per sequence that reached its end) -> verify
             -> update_from_output (the one commit point: tokens appended, stops, frees)

``executor`` (``core/executor.py``) says where a forward runs and how many steps are in flight:
inline and one (rung 3), through the ranks (rung 7), on a worker thread one ahead (rung 12).
``propose``/``verify`` are rung 6's seams (guesses computed as extra tokens, and which to keep).
"""
from __future__ import annotations

import time
from collections import deque

import torch
from torch.profiler import record_function

from ..memory import KVCounts, MemorySnapshot
from ..request import FinishReason, Request, RequestError
from ..runtime.interface import Engine, StepOutput
from ..layers.attention import get_attention_backend
from ..layers.config import ModelConfig
from ..layers.fused import layer_ops
from ..layers.kv_quant import get_format
from ..layers.linear import get_linear_kernel
from .beam import select_beams as core_select_beams
from .block_manager import BlockManager
from .config import CacheConfig, SchedulerConfig
from .executor import Executor, InlineExecutor, LaunchedStep, split_step_time
from .idle import IdleSteps
from .budget import BatchController
from .policy import SchedulingPolicy
from .runner import ModelRunner
from .sampler import Sampler, SamplerOutput, split_lookahead
from .scheduler import Scheduler, SchedulerOutput, SequenceGroup
from .sequence import Sequence


class PagedEngine(Engine):
    name = "paged"
    supports_abort = True
    supports_parallel = True    # n > 1 and beams share blocks
    refuses = frozenset()       # logprobs, prompt logprobs and every sampling control
    configs = (CacheConfig, SchedulerConfig, ModelConfig)

    def __init__(self, model, *, backend=None, runner=None, sampler=None, block_manager=None,
                 select_beams=None, step_cost=None, executor: Executor | None = None,
                 policy: SchedulingPolicy | None = None, controller: BatchController | None = None,
                 **options):
        """``options``: the fields of ``configs``, flat (``block_size=16``...), kept as
        ``cache_config``, ``scheduler_config``, ``model_config``. The rest replaces a part that
        is built by default: the attention ``backend``, the ``runner`` (``make_runner``), the
        ``sampler``, the KV allocator (``block_manager``: the visualizer's replays), beam search's
        choice (``select_beams``), and ``step_cost(sched) -> ms``, a cost model that times each
        step instead of the clock (notebook 12: the same run on every machine). The rungs plug
        in components: the ``executor`` (``core/executor.py``: where forwards run, how many steps
        in flight), the scheduling ``policy`` (``core/policy.py``) and the batch ``controller``
        (``core/budget.py``); the registry builds them from the rungs' options."""
        super().__init__(model, **options)
        cache, limits = self.cache_config, self.scheduler_config
        self.executor = executor or InlineExecutor()
        self.step_cost = step_cost
        self.kv_format = get_format(cache.kv_cache_dtype)    # how wide a slot is (rung 9)
        if block_manager is None:
            num_blocks = cache.num_blocks_for(self.kv_bytes_per_token, self.max_model_len,
                                              limits.max_num_seqs)
            block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        elif runner is None:
            raise ValueError("block_manager= replaces the KV layout the model runner reads: "
                             "pass a runner for it too")
        self.block_size = cache.block_size
        self.block_manager = block_manager
        self.scheduler = Scheduler(self.block_manager, limits.max_num_batched_tokens,
                                   limits.max_num_seqs, policy, self.eos_ids,
                                   self.max_model_len, select_beams or core_select_beams,
                                   self.observers.emit, controller)
        if runner is None:   # every option is checked by now: the KV pool is allocated last
            backend = backend or get_attention_backend(self.model_config.attention_backend,
                                                       model.device, model.dtype)
            runner = self.make_runner(block_manager.num_blocks, cache.block_size, backend)
        self.backend = backend   # (None when a runner was given without one)
        self.runner, self.sampler = runner, sampler or Sampler(self.eos_ids)
        self.aborted: list[Request] = []
        self.deferred_aborts: list[str] = []       # requests in a step in flight, to end after it
        self.in_flight: deque[LaunchedStep] = deque()
        self.num_launched, self.idle_steps = 0, IdleSteps()

    def make_runner(self, num_blocks: int, block_size: int, backend) -> ModelRunner:
        """The model runner (and with it the KV pool) for a pool of ``num_blocks`` blocks: the
        extension point later rungs override (rung 7 runs a stage of the layers)."""
        return ModelRunner(self.model, num_blocks, block_size, backend,
                           linear_kernel=self.linear_kernel(), kv_format=self.kv_format,
                           ops=self.layer_ops())

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V over all layers as this pool stores them (``kv_cache_dtype``;
        ``auto`` is the model's own unit, also for the visualizer's replays, which run no model)."""
        if self.kv_format.name == "auto":
            return self.model.kv_bytes_per_token
        return self.kv_format.bytes_per_token(*self.model.kv_geometry, self.model.dtype)

    def linear_kernel(self):
        """The kernel of the linear layers ``model_config.linear_backend`` names (linear.py)."""
        return get_linear_kernel(self.model_config.linear_backend, self.model.device,
                                 self.model.dtype)

    def layer_ops(self):
        """A layer's elementwise steps as ``model_config.layer_ops`` names them (fused.py)."""
        return layer_ops(self.model.dtype, self.model.device, self.model_config.layer_ops)

    # --- requests ---------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        super().validate(req)
        p = req.params
        width = max(p.n, p.beam_width)
        longest = min(req.prompt_len + p.max_tokens, self.max_model_len)
        why = self.block_manager.capacity_error(req, longest)
        if why is not None:
            raise RequestError(f"{req.request_id}: {why}; it could never run", field="max_tokens")
        if width > self.scheduler.max_num_batched_tokens:
            raise RequestError(f"{req.request_id}: n/beam_width {width} exceeds "
                               f"max_num_batched_tokens {self.scheduler.max_num_batched_tokens}",
                               field="n")

    def add_request(self, req: Request) -> None:
        self.scheduler.add(req)

    @property
    def groups(self) -> dict[str, SequenceGroup]:    # requests in flight, by id (the scheduler's)
        return self.scheduler.groups

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.aborted or self.in_flight)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_hit_tokens(self) -> int:
        return self.block_manager.prefix_hits

    def abort(self, request_id: str) -> bool:
        """Cancel a request now: its blocks go back to the pool at once; every sample keeps the
        tokens it has so far. A request in a step in flight ends once that step lands (its
        blocks are being written): the next ``step()`` reports it, with that step's tokens."""
        group = self.groups.get(request_id)
        if group is None or group.request.finished or request_id in self.deferred_aborts:
            return False
        if any(group in step.groups for step in self.in_flight):
            self.deferred_aborts.append(request_id)
            return True
        self.aborted.append(self.scheduler.finish_group(group, FinishReason.ABORT))
        return True

    def close(self) -> None:
        self._drain()
        self.executor.close()
        super().close()

    def _drain(self) -> None:    # steps in flight waited for (results dropped): K/V writes end
        for step in self.in_flight:
            try:
                self.wait(step)
            except Exception:        # the run is failing already; the reset goes on
                pass
        self.in_flight.clear()

    def reset(self) -> list[Request]:
        """Drop every request, steps in flight waited for first (``_drain``)."""
        self._drain()
        self.deferred_aborts = []
        dropped = [self.scheduler.finish_group(g, FinishReason.ABORT)
                   for g in list(self.groups.values())]
        dropped, self.aborted = dropped + self.aborted, []
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self.block_manager.release_all()   # anything still held was mid-step (a fork, say)
        return dropped

    # --- one step: launch, land -------------------------------------------------------------------
    def _step(self) -> StepOutput:
        """The one step loop (``core/executor.py``): launch steps until ``executor.depth`` are in
        flight, land the oldest, launch until ``executor.ahead`` are in flight again. Inline
        (rung 3) that is schedule -> forward -> sample -> commit, once per call."""
        out = self._take_aborted()
        self._launch_until(self.executor.depth)
        if not self.in_flight:
            return self._idle(out)
        self.land(self.in_flight[0], out)      # (popped once landed: a reset waits for it)
        self.in_flight.popleft()
        self._apply_deferred_aborts(out)
        self._launch_until(self.executor.ahead)
        return out

    def _launch_until(self, depth: int) -> None:
        while len(self.in_flight) < depth:
            self.propose()
            sched = self.schedule_step()
            if not sched.scheduled:
                return
            groups = {self.groups[s.request.request_id] for s, _ in sched.scheduled}
            step = LaunchedStep(sched, groups, index=self.num_launched)
            self.in_flight.append(step)   # first: if work went out (rung 7), a reset waits for it
            self.num_launched += 1
            try:
                self.launch(step)
            except BaseException:       # Ctrl-C, say: no handle = nothing went out, not in flight
                if step.handle is None:
                    self.in_flight.pop()
                raise

    def schedule_step(self) -> SchedulerOutput:     # (sequence, tokens) pairs within the budget
        return self.scheduler.schedule()

    def launch(self, step: LaunchedStep) -> None:   # step.handle: set once its work started
        step.handle = self.executor.submit(self._forward, step.sched)   # inline: computed now

    def _forward(self, sched: SchedulerOutput) -> tuple:
        """``execute``, timed once: its span for observers (``"executed"``), its ms for the step."""
        start = time.perf_counter()
        result = self.execute(sched)
        end = time.perf_counter()
        self.observers.emit("executed", data=(start, end))
        return result, (end - start) * 1000.0

    def execute(self, sched: SchedulerOutput):
        """Copies, then the forward over ``sched``: (sequences at their newest token, logits)."""
        self.runner.copy_blocks(sched.copies)
        return self.runner.run(sched.scheduled)

    def wait(self, step: LaunchedStep) -> tuple:
        """``step``'s (forward result, ms), kept on it: a step received is never waited for again."""
        if step.result is None:
            step.result = self.executor.wait(step.handle)
        return step.result

    def land(self, step: LaunchedStep, out: StepOutput) -> None:
        """Finish ``step`` where forwards run: time recorded, K/V counted, tokens committed."""
        result, forward_ms = self.wait(step)
        self.executor.call(self._complete_step, step, result, forward_ms, out)

    def _complete_step(self, step: LaunchedStep, result, forward_ms: float,
                       out: StepOutput) -> None:
        self.record_step_time(out, step.sched, forward_ms)
        if not step.committed:
            self.scheduler.update_after_forward(step.sched)
        self.finish_step(result, out)

    def finish_step(self, result, out: StepOutput) -> None:
        """``execute``'s result, its K/V counted: tokens (and asked-for prompt logprobs) in."""
        reached, logits, *prompt = result      # a runner that computes nothing returns two
        self.complete(reached, logits, out, prompt[0] if prompt else [])

    def _take_aborted(self) -> StepOutput:     # a step's output starts with the aborted ones
        out = StepOutput(finished=self.aborted)
        self.aborted = []
        return out

    def _apply_deferred_aborts(self, out: StepOutput) -> None:
        """End the requests aborted while a step holding them was in flight, once it landed."""
        waiting, self.deferred_aborts = self.deferred_aborts, []
        for request_id in waiting:
            self.abort(request_id)         # False if it finished in the step that landed
        out.finished += self.aborted
        self.aborted = []

    def _idle(self, out: StepOutput) -> StepOutput:
        """Nothing was scheduled: fine for a step while requests wait for memory held by running
        ones (or were just aborted); a bug when it cannot end (``IdleSteps``: raised)."""
        self.idle_steps.check(self.scheduler, bool(out.finished), self.total_steps)
        return out

    def complete(self, reached: list[Sequence], logits: torch.Tensor, out: StepOutput,
                 prompt_logprobs: list = ()) -> None:
        """Logits -> tokens, committed: a row per sequence (n > 1 samples share their prompt's),
        the 1 + k rows of a sequence with guesses to ``verify``, then ``update_from_output``.
        Observers see the pool at its fullest first ("computed": nothing committed yet)."""
        self.observers.emit("computed", data=reached)
        seqs, logits, lookahead = split_lookahead(reached, logits)
        with record_function("minillm::sample"):
            tokens, beam_logprobs = self.sampler(logits, self.scheduler.rows_to_sample(seqs))
        accepted = self.verify(lookahead) if lookahead else None
        sampled = SamplerOutput(tokens, beam_logprobs, accepted, list(prompt_logprobs))
        out.finished += self.scheduler.update_from_output(sampled)

    # --- extension points (rung 6 guesses ahead) ----------------------------------------------------
    def propose(self) -> None:
        """Before scheduling: give running sequences guesses (``Sequence.spec_token_ids``) for the
        scheduler to plan as extra tokens. Rung 3 guesses nothing."""

    def verify(self, lookahead: dict[Sequence, torch.Tensor]) -> dict[Sequence, list[int]]:
        """The tokens each sequence keeps of its guesses (plus the target's own next token), from
        its 1 + k rows of logits. Only called when ``propose`` guessed (rung 6)."""
        raise NotImplementedError(f"engine {self.name!r} proposes no guesses to verify")

    def record_step_time(self, out: StepOutput, sched: SchedulerOutput, forward_ms: float) -> None:
        """The step's time (its forward's, or ``step_cost``'s) into ``out`` and, where steps run
        one at a time (``executor.depth`` 1), the scheduler's clock and batch controller."""
        ms = forward_ms if self.step_cost is None else float(self.step_cost(sched))
        split_step_time(out, sched, ms)
        if self.executor.depth == 1:
            self.scheduler.observe_step(sched.num_tokens, ms)

    # --- what views may ask (runtime/interface.py) -----------------------------------------------------
    def describe(self) -> dict:
        return {**super().describe(), "policy": self.scheduler.policy.name,
                "kv_cache_dtype": self.kv_format.name, "layer_ops": self.runner.net.ops.name,
                **self.scheduler.controller.describe(), **self.executor.describe()}

    def run_extra(self) -> dict:
        return {**super().run_extra(), **self.executor.describe()}

    def batch_control(self) -> dict | None:
        controller = self.scheduler.controller
        return None if controller.name == "none" else controller.describe()

    def requests_in_flight(self) -> tuple[list[Request], list[Request]]:
        return ([g.request for g in self.scheduler.running],
                [g.request for g in self.scheduler.waiting])

    def live_tokens(self, request_id: str) -> list[int] | None:
        group = self.groups.get(request_id)
        return list(group.seqs[0].output_token_ids) if group is not None and group.seqs else None

    # --- memory -----------------------------------------------------------------------------------
    def _head(self) -> Request | None:
        """The request first in line for memory (what external fragmentation is measured for)."""
        waiting = self.scheduler.waiting
        return waiting[0].request if waiting else None

    def kv_counts(self) -> KVCounts:
        return self.block_manager.counts(self.scheduler.live_seqs(), self.kv_bytes_per_token,
                                         self._head())

    def snapshot(self) -> MemorySnapshot:
        return self.block_manager.snapshot(self.scheduler.live_seqs(), self.name, self.step_count,
                                           self.kv_bytes_per_token, self._head())
