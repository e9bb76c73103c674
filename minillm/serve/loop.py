"""``EngineLoop``: one thread owns the engine; HTTP handlers only submit, abort and listen.

Continuous batching as a server does it (notebook 02 teaches it offline): a request joins the
running batch at the *next* engine step. Only the loop thread touches the engine (it is not
thread-safe and need not be). Handlers (on the asyncio event loop) put ``("add", (at, request))``
and ``("abort", id)`` into a thread-safe inbox; the loop thread warms the engine up, then runs the
one driver (``runtime.driver.Driver`` on a ``WallClock``, the inbox as its ``InboxArrivals``),
which drains the inbox between steps and runs ``engine.step()``; after each step the loop hands
each request's new token ids (finally its ``Request``) to its ``asyncio.Queue`` with
``call_soon_threadsafe``, the one safe way to wake an event loop from another thread.

Guarantees: every accepted request gets exactly one final event (``done`` or ``error``); an abort
frees its KV blocks at once; at most ``max_waiting`` requests wait (``submit`` raises ``QueueFull``
beyond: a 429, never an unbounded queue); a step's exception fails the requests in flight with its
message, resets the engine (pool back to full) and the loop goes on serving.

Stats flow one way: the loop thread builds an ``EngineStats`` (``runtime/stats.py``) when it
starts, after each step and after a failure, and swaps it into ``self.stats``; ``/metrics``, the
dashboard and admission control read that record (and the loop's counters), never the engine.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..runtime.interface import Engine, StepOutput
from ..runtime.driver import Driver, InboxArrivals, WallClock
from ..runtime.stats import EngineStats
from ..memory import KVCounts
from ..metrics import StepRecord
from ..request import Request, RequestError, RequestOutput
from .metrics import ServerMetrics

log = logging.getLogger("minillm.serve")


class QueueFull(Exception):
    """The waiting queue is at ``max_waiting``: try again later (HTTP 429)."""


class ShuttingDown(QueueFull):
    """The loop is stopping: no new requests (HTTP 503)."""


class EngineFailed(Exception):
    """The engine can never serve again (``Engine.health_error``): HTTP 503 until a restart."""


@dataclass
class Event:
    kind: str                                    # "tokens" | "done" | "error"
    tokens: dict[int, list[int]] = field(default_factory=dict)   # sample index -> new token ids
    request: Request | None = None               # "done": the finished request
    error: str | None = None


@dataclass(eq=False)
class Handle:
    """One accepted request, as the loop thread sees it."""

    request: Request
    aio_loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: dict[int, int] = field(default_factory=dict)   # sample index -> tokens handed out
    last_token_time: float | None = None

    def push(self, event: Event) -> None:
        try:
            self.aio_loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:   # the event loop is closed (server shut down): nobody listens
            pass


OnStep = Callable[["EngineLoop", StepOutput], None]


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None,
                 max_waiting: int = 64, name: str = "minillm-engine-loop",
                 threads: int | None = None):
        """``threads``: torch's thread count, set on the loop thread when it starts (None: leave
        it). ``python -m minillm serve`` loads the model on one thread and gives the loop all of
        them: see ``serve/cli.py``."""
        if not engine.supports_abort:
            raise ValueError(f"engine {engine.name!r} cannot abort requests: serve needs "
                             "'dynamic' or 'paged'")
        self.engine = engine
        self.metrics = metrics or ServerMetrics(engine.model.name)
        self.max_waiting = max_waiting
        self.threads = threads
        self.on_step: list[OnStep] = []          # called on the loop thread after each step
        self.handles: dict[str, Handle] = {}     # in the engine, by request id (loop thread only)
        self.num_engine_errors = 0
        self.engine_step_s = 0.0                 # seconds inside engine.step()
        self.overhead_s = 0.0                    # seconds of the loop's own work after steps
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()            # guards _arriving, _entered and stats together
        self._arriving: dict[int, Handle] = {}   # submitted, not yet in the engine: id(request)
        self._entered = 0                        # handed to the engine since the latest record
        # the engine's latest record (built on the loop thread; readers take the reference)
        self.stats: EngineStats = EngineStats.of(engine)
        self._stop = threading.Event()
        self._warm, self._warm_error = threading.Event(), None
        self._clock = WallClock()                # arrival times: seconds since the loop was made
        self._driver = Driver(engine, self._clock, InboxArrivals(self._inbox, self._apply),
                              validate=False, rejects=(Exception,), on_reject=self._rejected,
                              on_admit=self._admitted, on_step=self._stepped,
                              on_error=self._step_failed, keep_steps=False)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    @property
    def step_count(self) -> int:
        """Steps the engine ran (it counts them itself), as of the latest record."""
        return self.stats.step

    @property
    def kv(self) -> KVCounts:
        """KV slots by kind, as of the latest record."""
        return self.stats.kv

    # --- the handlers' side (any thread; ``submit`` on the event loop) ---------------------------
    def start(self) -> "EngineLoop":
        """Start the loop thread and wait while it warms the engine up (``Engine.warm_up``; rung
        14 compiles there): a server listens once its engine is ready."""
        self._thread.start()
        self._warm.wait()
        if self._warm_error is not None:
            raise RuntimeError(f"the engine failed to warm up: {self._warm_error}")
        return self

    def alive(self) -> bool:
        """Whether the loop thread still runs (the server's /health asks)."""
        return self._thread.is_alive()

    def submit(self, req: Request, validated: bool = False) -> asyncio.Queue:
        """Accept ``req`` (RequestError if it can never run, QueueFull if the queue is full,
        EngineFailed if the engine is gone) and return the queue its events will arrive on. Call
        from the event loop; ``validated``: the caller already ran ``engine.validate`` (off the
        event loop: it looks at every token)."""
        if not validated:
            self.engine.validate(req)   # reads only fixed facts (vocabulary, context, pool size)
        if (why := self.engine.health_error()) is not None:
            raise EngineFailed(why)
        handle = Handle(req, asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:   # the loop's shutdown takes this lock too: no request is left behind
            if self._stop.is_set():
                raise ShuttingDown("the server is shutting down")
            waiting = self._waiting()
            if waiting >= self.max_waiting:
                self.metrics.rejected += 1
                raise QueueFull(f"{waiting} requests are already waiting (max_waiting="
                                f"{self.max_waiting}): try again later")
            self._arriving[id(req)] = handle
            # the driver stamps ``arrival_time`` on admission, from the time it was sent here
            self._inbox.put(("add", (self._clock.now(), req)))
        self.metrics.observe_accepted(req.prompt_len)
        return handle.queue

    def abort(self, request_id: str) -> None:
        """Cancel a request (its client left): a ``done``, reason ``abort``; if ended, nothing."""
        self._inbox.put(("abort", request_id))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the loop thread between two steps (to read the engine safely)."""
        self._inbox.put(("call", fn))

    def _waiting(self) -> int:
        """Under ``_lock``: the arrivals, those handed to the engine since the latest record (it
        cannot yet say where they are: they count as waiting, as they do in the engine until a
        step schedules them) and the record's waiting queue."""
        return len(self._arriving) + self._entered + self.stats.num_waiting

    def latest(self) -> tuple[EngineStats, int]:
        """The latest record and the waiting count that goes with it (``num_waiting``), read
        together: what ``/metrics`` shows."""
        with self._lock:
            return self.stats, self._waiting()

    def num_waiting(self) -> int:
        """Requests accepted and not yet running: admission control bounds this."""
        return self.latest()[1]

    def arriving(self) -> list[Request]:
        """Requests submitted but not yet in the engine (they join it at the next step), in the
        order they came: they wait too (``num_waiting`` counts them)."""
        with self._lock:
            return [handle.request for handle in self._arriving.values()]

    def num_running(self) -> int:
        return self.stats.num_running

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Ask the loop to stop after the current step (returns at once); requests still in
        flight then get an error event, so their streams end instead of holding a shutdown."""
        self._stop.set()
        self._inbox.put(("stop", None))

    def shutdown(self, timeout: float = 30.0) -> None:
        """``stop`` and wait for the loop thread to end."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # --- the loop thread -------------------------------------------------------------------------
    def _main(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        with self.engine.exclusive():    # an offline run() from another thread waits for us
            try:                         # on this thread: the one whose threads compute
                self.engine.warm_up()
            except Exception as e:  # noqa: BLE001 - start() raises it on the server's thread
                self._warm_error = e
                return
            finally:
                self._warm.set()
            try:
                self.refresh_stats()     # an offline run may have used the engine since __init__
                self._driver.run(until=self._stop.is_set)
            finally:
                self._fail_all("the server is shutting down", shutting_down=True)

    def _apply(self, op: str, arg) -> None:
        """An inbox item other than an add, on the loop thread between two steps."""
        if op == "abort":
            try:
                self.engine.abort(arg)   # False if it already finished: nothing to do
            except Exception:  # noqa: BLE001 - the request then simply runs to its end
                log.exception("abort of %s failed", arg)
        elif op == "call":
            try:
                arg()
            except Exception:  # noqa: BLE001 - a dashboard bug must not stop serving
                log.exception("call_soon callback failed")

    def refresh_stats(self, detail: bool = False) -> EngineStats:
        """Build the engine's record now and make it the latest (``detail``: with what a
        dashboard frame draws): on the loop thread (a step hook, a ``call_soon`` callback), or
        while that thread does not run. Anywhere else it is a ``RuntimeError``: one thread owns
        the engine."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            raise RuntimeError("only the engine loop's thread reads the engine while it runs")
        return self._set_stats(EngineStats.of(self.engine, detail))

    def _set_stats(self, stats: EngineStats) -> EngineStats:
        with self._lock:        # the record and the count of requests it does not know of yet
            self.stats, self._entered = stats, 0
        return stats

    def _handle(self, req: Request, entered: bool = False) -> Handle:
        with self._lock:
            self._entered += entered
            return self._arriving.pop(id(req))

    def _admitted(self, req: Request) -> None:
        self.handles[req.request_id] = self._handle(req, entered=True)

    def _rejected(self, req: Request, e: Exception) -> None:
        """``add_request`` raised (e.g. an id already in flight): only this request fails."""
        self._handle(req).push(Event("error", error=str(e) if isinstance(e, RequestError) else
                                     f"engine error: {type(e).__name__}: {e}"))

    def _step_failed(self, e: Exception) -> None:
        log.exception("engine step failed", exc_info=e)
        self.num_engine_errors += 1
        self._fail_all(f"engine error: {type(e).__name__}: {e}")

    def _stepped(self, out: StepOutput, record: StepRecord) -> None:
        t0, t1 = self._driver.step_time
        # the record first: a client told its request is done finds the step counted
        self._set_stats(EngineStats.of(self.engine, kv=record.kv))
        self._publish(out)
        for hook in self.on_step:
            try:
                hook(self, out)
            except Exception:  # noqa: BLE001 - a dashboard bug must not stop serving
                log.exception("on_step hook failed")
        # what serving adds to each step (handing tokens out, metrics, dashboard), apart from
        # the engine's own step: /metrics exposes both totals
        self.engine_step_s += t1 - t0
        self.overhead_s += time.perf_counter() - t1

    def _publish(self, out: StepOutput) -> None:
        now = time.perf_counter()
        gaps, num_new = [], 0
        finished = {r.request_id for r in out.finished}
        for rid, handle in list(self.handles.items()):
            if rid in finished:
                continue
            # each sample's tokens so far (a beam search's: none until it ends)
            new = self._new_tokens(handle, handle.request.samples)
            if new:
                num_new += sum(map(len, new.values()))
                if handle.last_token_time is not None:
                    gaps.append(now - handle.last_token_time)
                handle.last_token_time = now
                handle.push(Event("tokens", tokens=new))
        for req in out.finished:
            handle = self.handles.pop(req.request_id, None)
            if handle is None:
                continue
            new = self._new_tokens(handle, req.samples)
            num_new += sum(map(len, new.values()))
            if new:
                handle.push(Event("tokens", tokens=new))
            o = RequestOutput.from_request(req)
            self.metrics.observe_finished(req.finish_reason.value, o.ttft_s, o.latency_s,
                                          len(o.token_ids), req.priority)
            handle.push(Event("done", request=req))
        self.metrics.observe_step(gaps, num_new)

    @staticmethod
    def _new_tokens(handle: Handle, samples: list[list[int]]) -> dict[int, list[int]]:
        new = {}
        for i, ids in enumerate(samples):
            sent = handle.sent.get(i, 0)
            if len(ids) > sent:
                new[i] = list(ids[sent:])
                handle.sent[i] = len(ids)
        return new

    def _fail_all(self, message: str, shutting_down: bool = False) -> None:
        """End every request in flight with ``message`` and give all KV memory back; at shutdown
        also those submitted but never added (still in the inbox)."""
        try:
            self.engine.reset()
        except Exception:  # noqa: BLE001 - still tell every client
            log.exception("engine reset failed")
        try:
            self._set_stats(EngineStats.of(self.engine))
        except Exception:  # noqa: BLE001 - keep the previous record; still tell every client
            log.exception("engine stats failed after a reset")
        handles, self.handles = list(self.handles.values()), {}
        if shutting_down:
            with self._lock:   # ``submit`` checks the stop flag under this lock: none come later
                self._stop.set()
                handles += self._arriving.values()
                self._arriving.clear()
        for handle in handles:
            handle.push(Event("error", error=message))
