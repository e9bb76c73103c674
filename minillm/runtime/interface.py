"""The interface every engine implements (the core's: rungs 0-2 and the paged core alike).

An engine is driven one *step* at a time (one forward pass of the model, for whatever batch the
engine chose). Engines differ only in ``add_request``/``_step`` and in how they lay out KV memory
(``kv_counts``/``snapshot``). ``step`` is the same for all: it runs ``_step`` and counts it, so
the engine owns its counters (``step_count`` for this run, ``total_steps`` ever) and no caller
writes them. Nothing here loops: ``Engine.run`` hands its requests to the one run loop,
``driver.Driver`` (on a ``WallClock``), which also drives the visualizer's replays and the
server; it stamps arrivals, calls ``step`` until everything is done, records a ``StepRecord``
per step and returns outputs plus metrics.
"""
from __future__ import annotations

import numbers
import threading
import time
from contextlib import contextmanager

from typing import Callable, ClassVar

from tqdm.auto import tqdm

from .config import build_configs, config_attr
from ..memory import KVCounts, MemorySnapshot
from ..metrics import StepRecord
from ..models import LoadedModel, dtype_name
from ..request import Request, RequestError, RequestOutput
from ..structured import bind_grammar
from .driver import Driver, RunResult, ScheduledArrivals, WallClock  # noqa: F401 (RunResult: API)
from .step_output import StepOutput
from .observe import Observers


OnStep = Callable[[MemorySnapshot, StepRecord], None]
OnOutput = Callable[[RequestOutput], None]


class Engine:
    """Base class: validation, output building and the shared ``run`` loop."""

    name = "base"
    supports_abort = False
    supports_parallel = False   # n > 1 samples and beam search
    supports_lora = False       # requests with a LoRA adapter (rung 13)
    # SamplingParams fields this engine cannot honour, refused by name (``validate``): rungs 0-2
    # compute no log-probabilities; the paged core does them all (its rungs may refuse some)
    refuses: ClassVar[frozenset[str]] = frozenset({"logprobs", "prompt_logprobs"})
    serves_one_at_a_time = False
    # The config classes (``minillm.core.config``) whose fields are this engine's options
    configs: ClassVar[tuple[type, ...]] = ()

    def __init__(self, model: LoadedModel, **options):
        """``options``: the fields of ``configs``, flat (``block_size=4``); each config is made,
        and so checked, here and kept as ``self.cache_config`` etc. (``config_attr``)."""
        for config in build_configs(type(self).configs, options, type(self).__name__):
            setattr(self, config_attr(type(config)), config)
        self.model = model
        self.tokenizer = model.tokenizer
        self.eos_ids = model.eos_token_ids
        self.max_model_len = model.max_model_len
        self.step_count = 0          # steps of the current (or last) run: each run counts from 1
        self.total_steps = 0         # every step this engine ever ran
        self.observers = Observers(self)   # views watching each step's phases (``observe.py``)
        # One run at a time: a second thread's run() waits for the first (see ``exclusive``).
        self._run_lock = threading.Lock()
        self._run_thread: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's KV takes in this engine's cache (the model's dtype unless a paged
        engine stores it narrower: rung 9)."""
        return self.model.kv_bytes_per_token

    # --- what each step implements -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        raise NotImplementedError

    def _step(self) -> StepOutput:
        """One forward pass for whatever batch the engine picks (``step`` counts it)."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    def kv_counts(self) -> KVCounts:
        """KV slots by kind right now (the counts of ``snapshot`` without drawing it)."""
        raise NotImplementedError

    def snapshot(self) -> MemorySnapshot:
        raise NotImplementedError

    def num_running(self) -> int:
        """Requests holding KV memory right now (for peak-concurrency metrics)."""
        raise NotImplementedError

    def num_waiting(self) -> int:
        """Requests added but not yet holding KV memory."""
        raise NotImplementedError

    # torch threads this engine's own worker processes compute on, beside the caller's thread
    # (rung 11's prefill worker): a server gives its engine loop the cores that are left
    threads_in_workers = 0

    # counters an engine with a scheduler keeps (cumulative since the engine was made)
    num_preemptions = 0
    prefix_hit_tokens = 0

    def reset(self) -> list[Request]:
        """Drop every request in flight and give all KV memory back; return the dropped requests
        (marked aborted). ``run`` calls it when it ends by an exception, so that one failed call
        (a bad callback, Ctrl-C) never leaves stale requests behind for the next one."""
        raise NotImplementedError

    def health_error(self) -> str | None:
        """None while the engine can serve; else why it never will again (a server answers
        /health with 503 and this reason). Safe to call from any thread."""
        return None

    # --- what views may ask (the server's dashboard, the notebooks' views, the CLI): declared here
    # so that no view reaches into an engine; a rung with more to say overrides them ----------------
    has_prefill_pool = False    # rung 11: a second KV pool, on the prefill worker

    def describe(self) -> dict:
        """A view's header: the engine, its model and the dtype it computes in (the paged core
        adds its scheduling policy and KV format)."""
        return {"engine": self.name, "model": self.model.name,
                "dtype": dtype_name(self.model.dtype)}

    def batch_control(self) -> dict | None:
        """Rung 12's batch controller, as its ``describe()`` says (the cap, the fit, the load), or
        None where the batch is fixed: cheap enough for every ``/metrics`` scrape."""
        return None

    def requests_in_flight(self) -> tuple[list[Request], list[Request]] | None:
        """(running, waiting) requests in the engine's own order, or None for an engine that
        keeps no such lists."""
        return None

    def live_tokens(self, request_id: str) -> list[int] | None:
        """The output so far of a request in flight (its first sample when n > 1), or None."""
        return None

    def stages(self) -> dict[str, list[Request]]:
        """Requests on their way into this engine, by stage (rung 11: prefilling, in transfer)."""
        return {}

    def prefill_snapshot(self) -> MemorySnapshot | None:
        """The other pool's picture, for an engine that has one (``has_prefill_pool``)."""
        return None

    def close(self) -> None:
        """Stop what the engine started (worker processes) now rather than at exit."""

    def warm_up(self) -> None:
        """Prepare now what the first requests would otherwise wait for; a server calls it on
        its engine thread before it listens (vLLM captures its graphs at start-up the same way).
        Nothing to prepare by default; rung 14 compiles its decode step's batch sizes."""

    # --- the counters: the engine owns them, no driver writes them ------------------------------
    def step(self) -> StepOutput:
        """One step (``_step``), counted: ``step_count`` in this run, ``total_steps`` ever."""
        out = self._step()
        self.observers.emit("stepped", data=out)
        self.step_count += 1
        self.total_steps += 1
        return out

    def idle_step(self) -> StepOutput:
        """A step of a step clock in which nothing runs (the visualizer's idle ticks): numbered
        like any step (``step_count``), not one the engine ran (``total_steps``)."""
        self.step_count += 1
        return StepOutput()

    def begin_run(self) -> None:
        """A run starts (``Driver.run``): its steps count from 1."""
        self.step_count = 0

    def run_extra(self) -> dict:
        """What this engine adds to a run's ``metrics.extra`` (rung 6: its speculation totals)."""
        return {}

    # --- shared ---------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Reject what can never be served, with a message that says why (RequestError)."""
        if req.error:  # already found unservable while encoding the prompt
            raise RequestError(f"{req.request_id}: {req.error}")
        ids = req.prompt_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise RequestError(f"{req.request_id}: prompt_token_ids must be a list of token ids, "
                               f"got {type(ids).__name__}")
        if not ids:
            raise RequestError(f"{req.request_id}: empty prompt")
        # The length first: it costs nothing, while the checks below look at every token (a
        # 50 MB prompt would take seconds to be told it is too long)
        if len(ids) >= self.max_model_len:
            raise RequestError(f"{req.request_id}: prompt of {len(ids)} tokens is longer than the "
                               f"model's context ({self.max_model_len} tokens, including output)")
        wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if wrong:
            raise RequestError(f"{req.request_id}: prompt token ids must be integers, got "
                               f"{wrong[0]!r} ({type(wrong[0]).__name__})")
        req.prompt_token_ids = ids = [int(t) for t in ids]   # numpy ints -> plain ints
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{req.request_id}: prompt token id {bad[0]!r} outside the "
                               f"vocabulary [0, {vocab})")
        self._check_params(req)
        if req.lora_request is not None and not self.supports_lora:
            raise RequestError(f"{req.request_id}: a LoRA adapter needs enable_lora=True (engine "
                               f"{self.name!r} serves the base model only)")
        if (req.params.n > 1 or req.params.beam_width > 1) and not self.supports_parallel:
            raise RequestError(f"{req.request_id}: n > 1 and beam search need the 'paged' "
                               f"engine (this is {self.name!r})", field="n")

    def _check_params(self, req: Request) -> None:
        """The sampling fields this engine refuses (``refuses``), and ``logit_bias`` ids outside
        the vocabulary (they would index past the logits); a structured-output request gets its
        grammar here."""
        p = req.params
        refused = [f for f in p.fields_in_use() if f in self.refuses]
        if refused:
            raise RequestError(f"{req.request_id}: {refused[0]}={getattr(p, refused[0])!r} is "
                               f"not supported by engine {self.name!r} (use 'paged')",
                               field=refused[0])
        vocab = self.model.config.vocab_size
        bad = [t for t, _ in p.logit_bias if t >= vocab]
        if bad:
            raise RequestError(f"{req.request_id}: logit_bias token id {bad[0]} is outside the "
                               f"vocabulary [0, {vocab})", field="logit_bias")
        try:   # structured output: its grammar, compiled for this tokenizer (minillm/structured.py)
            bind_grammar(req, self.tokenizer, vocab, self.eos_ids)
        except ValueError as e:
            raise RequestError(f"{req.request_id}: {e}",
                               field=getattr(e, "field", "structured_outputs")) from None

    def add_lora(self, lora_request) -> object:
        """Read a LoRA adapter into host memory before requests use it (rung 13's engine; vLLM's
        ``add_lora``); a bad adapter is a ValueError naming what is wrong."""
        raise ValueError(f"engine {self.name!r} serves no LoRA adapters (enable_lora=True does)")

    def make_output(self, req: Request) -> RequestOutput:
        text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        return RequestOutput.from_request(req, text)

    def abort(self, request_id: str) -> bool:
        raise NotImplementedError(f"engine {self.name!r} runs one batch to the end; "
                                  "abort needs 'dynamic' or 'paged'")

    def run(self, requests: list[Request], on_step: OnStep | None = None,
            progress: bool = False, on_output: OnOutput | None = None) -> RunResult:
        """Serve ``requests`` (each arriving ``arrival_offset_s`` after the start) to completion.

        ``on_step(snapshot, record)`` is called after every step; ``on_output(output)`` once per
        request, as soon as it ends. If anything raises (a callback, Ctrl-C), every request still
        in flight is aborted and its memory freed before the exception propagates: the engine is
        clean for the next call. Calls from several threads are served one after another.
        """
        self.check_new_requests(requests)

        def output(out: RequestOutput) -> None:
            bar.update(1)
            if on_output is not None:
                on_output(out)

        def stepped(out: StepOutput, record: StepRecord) -> None:
            on_step(self.snapshot(), record)

        arrivals = ScheduledArrivals([(r.arrival_offset_s, r) for r in requests])
        with self.exclusive():
            bar = tqdm(total=len(requests), desc=self.name, unit="req", disable=not progress,
                       leave=False)
            try:
                result = Driver(self, WallClock(), arrivals, on_output=output, keep_outputs=True,
                                on_step=None if on_step is None else stepped).run()
            finally:
                bar.close()
        by_id = {o.request_id: o for o in result.outputs}
        result.outputs = [by_id[r.request_id] for r in requests]     # in the caller's order
        return result

    @staticmethod
    def check_new_requests(requests: list[Request]) -> None:
        """Requests of one run must be fresh ``Request`` objects with unique ids."""
        seen: set[str] = set()
        for req in requests:
            if not isinstance(req, Request):
                raise ValueError(f"run() takes Request objects, got {type(req).__name__}")
            if req.request_id in seen:
                raise ValueError(f"duplicate request id {req.request_id!r}: ids must be unique")
            if req.finished or req.arrival_time is not None or req.output_token_ids:
                raise ValueError(f"request {req.request_id!r} has already been run: make a new "
                                 "Request for each run")
            seen.add(req.request_id)

    @contextmanager
    def exclusive(self):
        """Hold the engine for one driver: ``run`` takes it, and so does the server's engine loop
        (``minillm.serve.loop``) for as long as it serves; a second thread waits. Re-entering from
        the same thread (a callback calling ``run``) is a ``RuntimeError``."""
        if self._run_thread == threading.get_ident():
            raise RuntimeError(f"engine {self.name!r} is already running on this thread: run() "
                               "and generate() cannot be called from inside their own callbacks")
        with self._run_lock:
            self._run_thread = threading.get_ident()
            try:
                yield
            finally:
                self._run_thread = None

    def record(self, out: StepOutput, step: int, time_s: float = 0.0, num_finished: int = 0,
               start: tuple[int, int] = (0, 0)) -> StepRecord:
        """The ``StepRecord`` of a step that just ran (the ``Driver`` records every step here).
        ``start``: the preemption and prefix-hit counters when the run began."""
        return StepRecord(
            step=step, time_s=time_s, prefill_ms=out.prefill_ms, decode_ms=out.decode_ms,
            batch_size=out.batch_size, num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens, kv=self.kv_counts(),
            num_running=self.num_running(), num_waiting=self.num_waiting(),
            num_finished=num_finished, num_preemptions=self.num_preemptions - start[0],
            prefix_hit_tokens=self.prefix_hit_tokens - start[1])


def timed_ms(fn, *args, **kwargs):
    """Run ``fn`` and return (result, milliseconds)."""
    t = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, (time.perf_counter() - t) * 1000.0
