"""Rung 3 — the paged engine: block manager + scheduler + our own forward (notebook 03).

One step, data flowing one way: ``Scheduler.schedule`` picks (sequence, tokens) pairs within the
token budget and reserves their KV slots -> ``ModelRunner.run`` does the copy-on-write copies and
one forward over all of them -> ``Sampler`` turns the logits of every sequence that reached its
end into a token (or a beam's log-probabilities) -> ``Scheduler.postprocess`` commits: appends,
forks, finishes and frees.

Two extension points let a later rung add to the step without copying it: ``propose`` (before
scheduling: guesses for a sequence to compute as extra tokens) and ``verify`` (which of them the
target keeps). Rung 6 (speculative decoding) is those two methods.
"""
from __future__ import annotations

import time
import weakref
from typing import Callable, Hashable

import torch
from torch.profiler import record_function

from ..memory import KVCounts, MemorySnapshot
from ..request import FinishReason, Request, RequestError
from .interface import Engine, StepOutput
from .attention import get_attention_backend
from .beam import select_beams as core_select_beams
from .block_manager import BlockManager
from .kv_quant import get_format
from .config import CacheConfig, ModelConfig, SchedulerConfig
from .fused import layer_ops
from .linear import get_linear_kernel
from .batch_controller import make_controller
from .policy import make_policy
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler, SchedulerOutput, SequenceGroup
from .sequence import Sequence

MAX_IDLE_STEPS = 64     # steps in a row that schedule nothing before the engine calls it a livelock



def weak_method(method: Callable) -> Callable:
    """``method``, bound to an engine, for a part the engine owns to call back without keeping
    the engine alive: a strong reference back is a reference cycle, and the engine's KV pool
    would then wait for the garbage collector after its last user let it go."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)

class PagedEngine(Engine):
    name = "paged"
    supports_abort = True
    supports_parallel = True    # n > 1 and beams share blocks
    refuses = frozenset()       # logprobs, prompt logprobs and every sampling control
    supports_async_scheduling = False   # rung 12's engine overlaps its steps
    bills_steps = True     # each step's time reaches the scheduler's clock and batch controller
    configs = (CacheConfig, SchedulerConfig, ModelConfig)

    def __init__(self, model, *, backend=None, runner=None, sampler=None, block_manager=None,
                 select_beams=None, step_cost=None, **options):
        """``options``: the fields of ``configs``, flat (``block_size=16``, ``max_num_seqs=64``,
        ``attention_backend=None``...); they are kept as ``cache_config``, ``scheduler_config``
        and ``model_config``. The rest is plumbing: ``backend`` replaces the attention backend
        ``get_attention_backend`` picks from ``attention_backend`` ("torch", "cpp", "triton"),
        ``runner``/``sampler`` the model runner and the sampler, ``block_manager`` the KV
        allocator (the visualizer replays workloads with a runner that computes nothing, under
        each allocator of ``minillm.engines.r5_allocators``), ``select_beams`` beam search's
        choice (``core.beam.select_beams``; the replay's repeats a recorded search); by default
        the real ones are built (the runner by ``make_runner``). ``step_cost(sched) -> ms``
        bills each step by a cost model instead of the measured forward (notebook 12, the
        controller's tests: the same run on every machine)."""
        super().__init__(model, **options)
        cache, limits = self.cache_config, self.scheduler_config
        if limits.async_scheduling and not self.supports_async_scheduling:
            raise ValueError(f"async_scheduling=True: engine {self.name!r} does not overlap its "
                             "steps (rung 12's does: engine 'paged' without speculative, "
                             "pipeline, tensor parallel or disaggregated serving)")
        if not self.bills_steps and (limits.policy == "slo" or limits.batch_controller != "none"):
            raise ValueError(f"policy={limits.policy!r}, batch_controller="
                             f"{limits.batch_controller!r}: engine {self.name!r} bills no step "
                             "time to the scheduler (its micro-batches overlap), and 'slo' and "
                             "'tpot' run on that clock: use engine 'paged'")
        self.step_cost = step_cost
        self.kv_format = get_format(cache.kv_cache_dtype)    # how wide a slot is (rung 9)
        if block_manager is None:
            num_blocks = cache.num_blocks_for(self.kv_bytes_per_token, self.max_model_len,
                                              limits.max_num_seqs)
            block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                         weak_method(self.prefix_seed))
        elif runner is None:
            raise ValueError("block_manager= replaces the KV layout the model runner reads: "
                             "pass a runner for it too")
        self.block_size = cache.block_size
        self.block_manager = block_manager
        self.scheduler = Scheduler(self.block_manager, limits.max_num_batched_tokens,
                                   limits.max_num_seqs, make_policy(limits), self.eos_ids,
                                   self.max_model_len, select_beams or core_select_beams,
                                   self.observers.emit, make_controller(limits))
        if runner is None:   # every option is checked by now: the KV pool is allocated last
            backend = backend or get_attention_backend(self.model_config.attention_backend,
                                                       model.device, model.dtype)
            runner = self.make_runner(block_manager.num_blocks, cache.block_size, backend)
        self.backend = backend   # (None when a runner was given without one)
        self.runner, self.sampler = runner, sampler or Sampler(self.eos_ids)
        self.aborted: list[Request] = []
        self._idle_run = (-2, 0)       # (step of the latest step that scheduled nothing, in a row)

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
    def groups(self) -> dict[str, SequenceGroup]:
        """Requests in flight, by id (the scheduler owns them)."""
        return self.scheduler.groups

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.aborted)

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
        tokens it has so far."""
        group = self.groups.get(request_id)
        if group is None or group.request.finished:
            return False
        self.aborted.append(self.scheduler.finish_group(group, FinishReason.ABORT))
        return True

    def reset(self) -> list[Request]:
        dropped = [self.scheduler.finish_group(g, FinishReason.ABORT)
                   for g in list(self.groups.values())]
        dropped += self.aborted
        self.aborted = []
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self.block_manager.release_all()   # anything still held was mid-step (a fork, say)
        return dropped

    # --- one step ---------------------------------------------------------------------------------
    def _step(self) -> StepOutput:
        """One step in named phases, each a seam a rung overrides rather than copying the step
        (rung 11's prefill worker: ``schedule_step`` leaves parked requests out, ``execute``
        stops at the K/V, ``finish_step`` parks what reached its prompt's end)."""
        out = self._take_aborted()
        self.propose()
        sched = self.schedule_step()
        if not sched.scheduled:
            return self._idle(out)
        t = time.perf_counter()
        result = self.execute(sched)
        self.bill(out, sched, (time.perf_counter() - t) * 1000.0)
        self.scheduler.commit_computed(sched)
        self.finish_step(result, out)
        return out

    def schedule_step(self) -> SchedulerOutput:
        """What this step computes: (sequence, tokens) pairs within the budget."""
        return self.scheduler.schedule()

    def execute(self, sched: SchedulerOutput):
        """The forward pass over ``sched`` (K/V written): the sequences that reached their newest
        token and their logits rows (observers see its span: ``"executed"``)."""
        start = time.perf_counter()
        self.runner.copy_blocks(sched.copies)
        result = self.runner.run(sched.scheduled)
        self.observers.emit("executed", data=(start, time.perf_counter()))
        return result

    def finish_step(self, result, out: StepOutput) -> None:
        """What becomes of ``execute``'s result once its K/V are committed: prompt logprobs (for
        the requests that asked) and tokens."""
        reached, logits, *prompt = result      # a runner that computes nothing returns two
        if prompt and prompt[0]:
            self.scheduler.commit_prompt_logprobs(prompt[0])
        self.complete(reached, logits, out)

    def _take_aborted(self) -> StepOutput:
        """A step's output starts with the requests aborted since the last step."""
        out = StepOutput(finished=self.aborted)
        self.aborted = []
        return out

    def _idle(self, out: StepOutput) -> StepOutput:
        """Nothing was scheduled: fine for a step while requests wait for memory held by running
        ones (or were just aborted), a bug if the pool is empty and the queue still is not, or if
        it goes on for ``MAX_IDLE_STEPS`` steps in a row (a livelock: raised, never a hang)."""
        sched = self.scheduler
        if not sched.running and sched.waiting and not out.finished:
            raise RuntimeError("scheduler made no progress with an empty pool (a bug)")
        step = self.total_steps                  # idle steps count only when in a row
        stuck = bool(sched.running or sched.waiting) and not out.finished
        run = self._idle_run[1] + 1 if stuck and self._idle_run[0] == step - 1 else int(stuck)
        self._idle_run = (step, run)
        if run >= MAX_IDLE_STEPS:
            self._idle_run = (-2, 0)
            raise RuntimeError(
                f"the scheduler scheduled nothing for {MAX_IDLE_STEPS} steps in a row while "
                f"{len(sched.running)} requests run and {len(sched.waiting)} wait: no progress "
                "(does preempt free the blocks? do a preempted request's samples adopt its prompt "
                "again, _readopt_prompt?)")
        return out

    def complete(self, reached: list[Sequence], logits: torch.Tensor, out: StepOutput) -> None:
        """Turn a forward's logits into tokens and commit them: sample one row per sequence (n > 1
        samples fork here, sharing their prompt's row), hand the 1 + k rows of each sequence with
        guesses to ``verify``, then ``postprocess`` appends, finishes and frees. Observers see
        the pool at its fullest first (phase "computed": every K/V written, nothing committed)."""
        self.observers.emit("computed", data=reached)
        plain, lookahead, r = [], {}, 0
        for seq in reached:
            k = len(seq.spec_token_ids)
            if k:
                lookahead[seq] = logits[r:r + k + 1]
            else:
                plain.append(r)
            r += k + 1
        if lookahead:
            logits = logits[plain]
        seqs = [s for s in reached if not s.spec_token_ids]
        with record_function("minillm::sample"):
            tokens, beam_logprobs = self.sampler(logits, self.scheduler.rows_to_sample(seqs))
        accepted = self.verify(lookahead) if lookahead else None
        out.finished += self.scheduler.postprocess(tokens, beam_logprobs, accepted)

    # --- extension points (rung 6 guesses ahead) ----------------------------------------------------
    def propose(self) -> None:
        """Before scheduling: give running sequences guesses (``Sequence.spec_token_ids``) for the
        scheduler to plan as extra tokens. Rung 3 guesses nothing."""

    def prefix_seed(self, request: Request) -> Hashable:
        """What a request's K/V depend on besides its tokens: its prefix-cache blocks are hashed
        from it, so requests with different seeds never share one. Rung 3: nothing (None); rung
        13: the request's LoRA adapter."""
        return None

    def verify(self, lookahead: dict[Sequence, torch.Tensor]) -> dict[Sequence, list[int]]:
        """The tokens each sequence keeps of its guesses (plus the target's own next token), from
        its 1 + k rows of logits. Only called when ``propose`` guessed (rung 6)."""
        raise NotImplementedError(f"engine {self.name!r} proposes no guesses to verify")

    def bill(self, out: StepOutput, sched: SchedulerOutput, measured_ms: float) -> None:
        """The step's time (measured, or ``step_cost``'s) into ``out`` and, where steps do not
        overlap (``bills_steps``), the scheduler's clock and batch controller (rung 12)."""
        ms = measured_ms if self.step_cost is None else float(self.step_cost(sched))
        self._account(out, sched, ms)
        if self.bills_steps:
            self.scheduler.observe_step(sched.num_tokens, ms)

    @staticmethod
    def _account(out: StepOutput, sched: SchedulerOutput, ms: float) -> None:
        """A mixed step's forward time is split between prefill and decode by token count; a
        verification's 1 + k tokens count as decode (they produce output, not a prompt)."""
        n_all = sched.num_tokens
        n_dec = sum(n for s, n in sched.scheduled if s.spec_token_ids
                    or (n == 1 and s.num_computed_tokens >= s.prompt_len))
        out.prefill_ms, out.decode_ms = ms * (n_all - n_dec) / n_all, ms * n_dec / n_all
        out.num_prefill_tokens, out.num_decode_tokens = n_all - n_dec, n_dec
        out.batch_size = len(sched.scheduled)

    # --- what views may ask (core/interface.py) -----------------------------------------------------
    def describe(self) -> dict:
        return {**super().describe(), "policy": self.scheduler.policy.name,
                "kv_cache_dtype": self.kv_format.name, "layer_ops": self.runner.net.ops.name,
                **self.scheduler.controller.describe()}

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
