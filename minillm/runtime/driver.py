"""The one run loop: every caller that drives an engine goes through a ``Driver`` (notebook 02).

A ``Driver`` does three things, each in one place:
- ``admit``: requests whose time has come are stamped (``arrival_time``; ``added_step`` = the
  engine's ``step_count``), validated and handed to ``Engine.add_request``. One that can never
  run (``RequestError``) finishes with an ERROR output, or goes to ``on_reject``.
- ``step``: ``engine.step()`` (the instance attribute: tests replace it to make a step fail), the
  step's ``StepRecord`` (``Engine.record``) and the outputs of the requests it finished.
- ``run``: the loop, while anything is still to arrive or unfinished. If it ends by an exception,
  the engine is reset and every request of the run is aborted before the exception propagates.

Callers differ only in *when* requests arrive and in what idle time is, so that is what they
plug in: a clock and a source of arrivals.

- ``Engine.run`` / ``LLM.run``: a ``WallClock`` (idle: sleep until the next arrival) and
  ``ScheduledArrivals`` at each request's ``arrival_offset_s``;
- ``viz.replay.simulate`` (notebook 05): a ``StepClock("tick")`` or ``StepClock("jump")`` and
  ``ScheduledArrivals`` at each request's ``arrival_step``;
- ``viz.schedule_figures.run_by_steps`` (notebook 03): a ``StepClock("admit")``;
- ``serve.loop.EngineLoop``: a ``WallClock`` (idle: wait on the inbox) and ``InboxArrivals``,
  the handlers' thread-safe queue.

The engine owns its counters (``Engine.step`` counts ``step_count`` and ``total_steps``): a driver
reads them and never writes them.
"""
from __future__ import annotations

import itertools
import queue
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Protocol

from ..metrics import RunMetrics, StepRecord, summarize
from ..request import FinishReason, Request, RequestError, RequestOutput

from .step_output import StepOutput

Idle = Literal["wait", "tick", "admit"]        # what the driver does when nothing runs
OnStepped = Callable[[StepOutput, StepRecord], None]
OnOutput = Callable[[RequestOutput], None]


class Engine(Protocol):
    """What the run loop needs of an engine: ``runtime/interface.py``'s ``Engine`` is one (it
    imports this module to run itself, so this one names only what it calls)."""

    name: str
    step_count: int
    num_preemptions: int
    prefix_hit_tokens: int
    kv_bytes_per_token: int

    def validate(self, req: Request) -> None: ...
    def add_request(self, req: Request) -> None: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> StepOutput: ...
    def idle_step(self) -> StepOutput: ...

    def record(self, out: StepOutput, step: int, time_s: float, num_finished: int,
               start: tuple[int, int]) -> StepRecord: ...

    def make_output(self, req: Request) -> RequestOutput: ...
    def begin_run(self) -> None: ...
    def run_extra(self) -> dict: ...
    def reset(self) -> list[Request]: ...


@dataclass
class RunResult:
    outputs: list[RequestOutput]
    metrics: RunMetrics
    steps: list[StepRecord]


# --- arrivals -------------------------------------------------------------------------------------
class Arrivals(Protocol):
    def __bool__(self) -> bool: ...                 # more may still arrive
    def next_at(self) -> float | None: ...          # the next arrival's time (None: unknown)
    def due(self, now: float) -> Iterator[tuple[float, Request]]: ...   # (at, request), in order
    def wait(self, timeout: float) -> None: ...     # idle: until ``timeout`` or an arrival
    def pending(self) -> list[Request]: ...         # not arrived yet (a failed run aborts them)


class ScheduledArrivals:
    """Requests at known times, ``(at, request)`` in seconds or steps; equal times keep their
    order in the list."""

    def __init__(self, items: list[tuple[float, Request]]):
        self._items = deque(sorted(items, key=lambda a: a[0]))

    def __bool__(self) -> bool:
        return bool(self._items)

    def next_at(self) -> float | None:
        return self._items[0][0] if self._items else None

    def due(self, now: float) -> Iterator[tuple[float, Request]]:
        while self._items and self._items[0][0] <= now:
            yield self._items.popleft()

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)          # nothing can arrive sooner than scheduled

    def pending(self) -> list[Request]:
        return [req for _, req in self._items]


class InboxArrivals:
    """Requests sent from other threads (a server's handlers) through a thread-safe queue of
    ``(op, arg)`` items. ``("add", (at, request))`` arrives; any other op is ``apply_op(op, arg)``,
    run on the driver's thread in queue order between the adds (so an abort sent right after its
    add finds the request in the engine). Always open: more may come at any time."""

    def __init__(self, inbox: queue.Queue, apply_op: Callable[[str, object], None]):
        self.inbox, self.apply_op = inbox, apply_op
        self._held: deque = deque()            # taken off the queue while waiting

    def __bool__(self) -> bool:
        return True

    def next_at(self) -> float | None:
        return None

    def due(self, now: float) -> Iterator[tuple[float, Request]]:
        while True:
            try:
                op, arg = self._held.popleft() if self._held else self.inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                yield arg
            else:
                self.apply_op(op, arg)

    def wait(self, timeout: float) -> None:
        try:
            self._held.append(self.inbox.get(timeout=timeout))
        except queue.Empty:
            pass

    def pending(self) -> list[Request]:
        return []                    # the owner of the inbox answers for what is still in it


# --- clocks ---------------------------------------------------------------------------------------
class Clock(Protocol):
    def now(self, engine: Engine) -> float: ...               # in the arrivals' unit
    def elapsed(self) -> float: ...                           # StepRecord.time_s, run duration
    def stamp(self, req: Request, at: float) -> None: ...     # set ``arrival_time``
    def idle(self, engine: Engine, arrivals: Arrivals) -> Idle: ...


class WallClock:
    """Seconds since the clock was made. Idle time passes in ``arrivals.wait``: asleep until the
    next scheduled arrival, or blocked on an inbox (woken at once by a new request)."""

    poll_s = 0.1       # an inbox's wait: how often a server's loop looks at its stop flag

    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self, engine: Engine | None = None) -> float:
        return time.perf_counter() - self.t0

    def elapsed(self) -> float:
        return self.now()

    def stamp(self, req: Request, at: float) -> None:
        req.arrival_time = self.t0 + at

    def idle(self, engine: Engine, arrivals: Arrivals) -> Idle:
        at = arrivals.next_at()
        arrivals.wait(self.poll_s if at is None else max(0.0, at - self.now()))
        return "wait"


class StepClock:
    """Engine steps: a request due at step k is added once k steps of the run are done, so a
    run is the same on every machine. When nothing runs, ``idle`` says how time passes:
    "jump": to the next arrival, recording no step (the replay of a trace);
    "tick": one empty step at a time, recorded (synthetic timelines, where steps are time);
    "admit": the next request comes in now, later ones keep their steps (notebook 03)."""

    def __init__(self, idle: Literal["jump", "tick", "admit"] = "jump"):
        if idle not in ("jump", "tick", "admit"):
            raise ValueError(f"idle must be 'jump', 'tick' or 'admit', got {idle!r}")
        self.mode = idle
        self.skipped: float = 0     # steps jumped over while idle

    def now(self, engine: Engine) -> float:
        return self.skipped + engine.step_count

    def elapsed(self) -> float:
        return 0.0                  # records of a step clock carry no time

    def stamp(self, req: Request, at: float) -> None:
        req.arrival_time = time.perf_counter()

    def idle(self, engine: Engine, arrivals: Arrivals) -> Idle:
        if self.mode == "jump":
            self.skipped = arrivals.next_at() - engine.step_count
            return "wait"
        return self.mode


# --- the driver -----------------------------------------------------------------------------------
class Driver:
    """Drives ``engine`` through the requests of ``arrivals`` on ``clock`` (see the module).

    ``validate``: run ``engine.validate`` on admission (a server validates before queueing).
    ``on_reject(req, error)``: a request whose admission raised one of ``rejects`` (default: a
    ``RequestError``); without it the request finishes with ERROR and gets an output.
    ``on_admit(req)``: a request is in the engine. ``on_output(output)``: once per request, as
    soon as it ends (outputs are built only for it, or with ``keep_outputs``).
    ``on_step(step_output, record)``: after every step. ``on_error(exc)``: a step that raised
    an ``Exception`` (the server: fail the requests in flight, reset, go on); without it the run
    ends: the engine is reset, every request of the run aborted, and the exception propagates.
    ``max_steps``: a bound that turns a run that never ends into a ``RuntimeError``.
    """

    def __init__(self, engine: Engine, clock: Clock, arrivals: Arrivals, *, validate: bool = True,
                 rejects: tuple[type[Exception], ...] = (RequestError,),
                 on_reject: Callable[[Request, Exception], None] | None = None,
                 on_admit: Callable[[Request], None] | None = None,
                 on_output: OnOutput | None = None, on_step: OnStepped | None = None,
                 on_error: Callable[[Exception], None] | None = None,
                 max_steps: int | None = None, keep_steps: bool = True,
                 keep_outputs: bool = False):
        self.engine, self.clock, self.arrivals = engine, clock, arrivals
        self.validate, self.rejects = validate, rejects
        self.on_reject, self.on_admit, self.on_output = on_reject, on_admit, on_output
        self.on_step, self.on_error, self.max_steps = on_step, on_error, max_steps
        self.keep_steps, self.keep_outputs = keep_steps, keep_outputs
        self.steps: list[StepRecord] = []
        self.kept_outputs: dict[str, RequestOutput] = {}     # with keep_outputs, by request id
        self.num_steps = self.num_finished = 0
        self.step_time = (0.0, 0.0)          # perf_counter() before and after the latest step
        self.start = (0, 0)                  # the engine's preemption and prefix-hit counters
        self._in_flight: dict[int, Request] = {}   # admitted, not finished: a failed run aborts

    # --- admission --------------------------------------------------------------------------------
    def admit(self, now: float | None = None, limit: int | None = None) -> list[Request]:
        """Add every request due by ``now`` (default: the clock's), at most ``limit`` of them;
        return those the engine took."""
        due = self.arrivals.due(self.clock.now(self.engine) if now is None else now)
        return [req for at, req in itertools.islice(due, limit) if self._admit(at, req)]

    def _admit(self, at: float, req: Request) -> bool:
        self.clock.stamp(req, at)
        self._in_flight[id(req)] = req
        try:
            if self.validate:
                self.engine.validate(req)
            self.engine.add_request(req)
        except self.rejects as e:
            del self._in_flight[id(req)]
            if self.on_reject is not None:
                self.on_reject(req, e)
            else:
                req.finish(FinishReason.ERROR, error=str(e))
                self._ended(req, RequestOutput.from_request(req))
            return False
        req.added_step = self.engine.step_count
        if self.on_admit is not None:
            self.on_admit(req)
        return True

    # --- one step ---------------------------------------------------------------------------------
    def step(self, idle: bool = False) -> StepRecord | None:
        """One engine step (``idle``: an empty one, see ``StepClock``) and its ``StepRecord``;
        None if the step raised and ``on_error`` took it."""
        if self.max_steps is not None and self.num_steps >= self.max_steps:
            raise RuntimeError(f"{self.engine.name}: not done after {self.max_steps} steps")
        t = time.perf_counter()
        try:
            out = self.engine.idle_step() if idle else self.engine.step()
        except Exception as e:
            if self.on_error is None:
                raise
            self._in_flight.clear()          # ``on_error`` ends them all (the engine is reset)
            self.on_error(e)
            return None
        self.step_time = (t, time.perf_counter())
        self.num_steps += 1
        for req in out.finished:
            self._in_flight.pop(id(req), None)
            self._ended(req)
        record = self.engine.record(out, self.engine.step_count, self.clock.elapsed(),
                                    self.num_finished, self.start)
        if self.keep_steps:
            self.steps.append(record)
        if self.on_step is not None:
            self.on_step(out, record)
        return record

    def _ended(self, req: Request, output: RequestOutput | None = None) -> None:
        self.num_finished += 1
        if not self.keep_outputs and self.on_output is None:
            return                       # a replay has no tokenizer to decode with
        output = output or self.engine.make_output(req)
        if self.keep_outputs:
            self.kept_outputs[output.request_id] = output
        if self.on_output is not None:
            self.on_output(output)

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None = None) -> RunResult:
        """Admit and step until nothing is left to arrive or to finish (or ``until()`` is true);
        return the outputs kept, the metrics and the step records."""
        self.engine.begin_run()
        self.start = (self.engine.num_preemptions, self.engine.prefix_hit_tokens)
        stop = until or (lambda: False)
        try:
            while (self.arrivals or self.engine.has_unfinished()) and not stop():
                self.admit()
                if self.engine.has_unfinished():
                    self.step()
                elif self.arrivals:
                    self._idle()
        except BaseException:
            self.abort_all()
            raise
        outputs = list(self.kept_outputs.values())
        metrics = summarize(self.engine.name, outputs, self.steps, self.clock.elapsed(),
                            self.engine.kv_bytes_per_token)
        metrics.extra.update(self.engine.run_extra())
        return RunResult(outputs, metrics, self.steps)

    def _idle(self) -> None:
        what = self.clock.idle(self.engine, self.arrivals)
        if what == "tick":
            self.step(idle=True)
        elif what == "admit":
            self.admit(now=self.arrivals.next_at(), limit=1)

    def abort_all(self) -> None:
        """Reset the engine (all KV memory back) and abort every request of the run not yet
        finished, admitted or still to arrive: the engine is clean for the next run."""
        self.engine.reset()
        for req in [*self._in_flight.values(), *self.arrivals.pending()]:
            if not req.finished:
                req.finish(FinishReason.ABORT)
        self._in_flight.clear()
