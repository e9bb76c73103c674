"""Rung 12's overlapped step: ``async_scheduling=True`` (vLLM's name; notebook 12).

The core's step is strictly serial: schedule, forward, sample, commit — then the caller (the
driver, a server's loop) detokenizes and streams what finished, records the step, admits new
requests, and only then does the next step start. ``AsyncEngine`` keeps every phase of the core
and changes *when* the forward runs: each ``step()``

1. joins the forward launched by the previous ``step()`` (step N), bills it, commits its K/V
   (``commit_computed``) and samples and lands its tokens (``finish_step``) — exactly as the core;
2. schedules step N + 1 (``schedule_step``) on the committed state and launches its forward on
   a worker thread;
3. returns step N's output at once.

So step N + 1's forward computes while the caller does step N's host work: the detokenizing,
streaming and bookkeeping of the driver and the server never delay the next forward. Torch
releases the GIL inside its kernels, so a Python thread is enough to overlap the two. All of a
step's torch work (the forward, then sampling while the caller waits) runs on that one thread,
with the caller's thread count: one OpenMP team (docs/rungs/12_realtime.md: why two cost).

Why this variant and not vLLM v1's placeholders (schedule N + 1 *while* N computes, the token
not yet sampled filled in on the device): scheduling N + 1 before N's tokens land means planning
for sequences that may be about to stop, and putting a token into a sequence before it is
sampled — a second writer beside ``Request.commit``. Here N + 1 is scheduled after N committed,
so tokens (greedy and seeded), preemption, n > 1, beams and prefix caching are the synchronous
engine's by construction (``tests/test_async_scheduling.py`` checks it); what overlaps is the
host work outside the engine. Notebook 12 measures how much that is.

Nothing the forward reads may change while it runs. New requests only join the waiting queue
(the forward reads scheduled sequences only); an abort that comes while a forward is in flight is
applied once that step has landed (the request ends at the next ``step()``, with that step's
token); ``reset`` waits for the forward first. ``AsyncSpeculativeEngine`` is rung 6 overlapped
the same way: its ``propose`` (after step N landed) and ``verify`` (in ``finish_step``) are the
core's extension points, which this step already calls. Pipeline and tensor parallelism and
disaggregation are other steps: they refuse ``async_scheduling`` (``PagedEngine.__init__``).
"""
from __future__ import annotations

import ctypes
import functools
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ...core.engine import PagedEngine
from ...core.interface import StepOutput
from ...core.scheduler import SchedulerOutput
from ...request import Request
from ..r6_speculative.engine import SpeculativeEngine


@functools.cache
def _openmp_pause():
    """``omp_pause_resource_all`` of the OpenMP runtime torch loaded (found in this process's
    memory map: Linux), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp")):
            try:
                return ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):     # a runtime older than OpenMP 5.0
                continue
    return None


def release_idle_openmp_threads() -> bool:
    """Let the calling thread's idle OpenMP threads go. A thread that has run a parallel torch op
    (the caller loaded the model, built the engine) keeps its team's threads; with the worker's
    team beside them libgomp manages more threads than there are cores and stops letting idle
    ones spin. Measured offline, bf16, 2 threads (a scratch script, two rounds): the overlapped
    step at 0.79x / 0.80x of sync with the caller's team kept, 0.91x / 0.97x with it let go."""
    pause = _openmp_pause()
    return pause is not None and pause(1) == 0      # 1: omp_pause_soft


@dataclass
class Overlap:
    """What overlapping bought, summed over steps: the forwards' time, the time ``step()`` was
    blocked waiting for them, and the host time hidden behind them (the difference)."""

    steps: int = 0
    forward_ms: float = 0.0
    waited_ms: float = 0.0

    @property
    def hidden_ms(self) -> float:
        return max(0.0, self.forward_ms - self.waited_ms)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "forward_ms": round(self.forward_ms, 3),
                "waited_ms": round(self.waited_ms, 3), "hidden_ms": round(self.hidden_ms, 3)}


@dataclass
class InFlight:
    sched: SchedulerOutput
    future: Future               # -> (execute's result, forward ms)


class AsyncEngine(PagedEngine):
    name = "paged-async"
    supports_async_scheduling = True

    def __init__(self, model, **options):
        super().__init__(model, **options)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-forward")
        self.in_flight: InFlight | None = None
        self.deferred_aborts: list[str] = []
        self.overlap = Overlap()

    # --- the step: the core's phases, the forward one step later --------------------------------
    def _step(self) -> StepOutput:
        out = self._take_aborted()
        landed = self.in_flight is not None
        if landed:
            self._land(out)
        self._apply_deferred_aborts(out)
        self.propose()
        sched = self.schedule_step()
        if sched.scheduled:
            self._launch(sched)
        elif not landed:
            return self._idle(out)
        return out

    def _launch(self, sched: SchedulerOutput) -> None:
        # the worker computes on as many threads as the thread that steps the engine would, and
        # in the only team: the caller's idle threads go first
        release_idle_openmp_threads()
        self.in_flight = InFlight(sched, self.worker.submit(self._forward, sched,
                                                            torch.get_num_threads()))

    def _forward(self, sched: SchedulerOutput, threads: int):
        """On the worker thread: the core's ``execute`` (copies, then the forward), timed."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        t = time.perf_counter()
        result = self.execute(sched)
        return result, (time.perf_counter() - t) * 1000.0

    def _land(self, out: StepOutput) -> None:
        """Join the forward in flight and finish its step as the core does: bill, commit the K/V,
        sample and land the tokens."""
        flight, t = self.in_flight, time.perf_counter()
        try:
            result, forward_ms = flight.future.result()  # a forward's exception is raised here
        finally:
            # Ctrl-C while waiting leaves the forward in flight, for ``reset`` to wait for:
            # its K/V writes must end before the blocks go back to the pool.
            if flight.future.done():
                self.in_flight = None
        self.overlap.waited_ms += (time.perf_counter() - t) * 1000.0
        self.overlap.forward_ms += forward_ms
        self.overlap.steps += 1
        # The rest runs on the forward's thread while this one waits (nothing runs beside it):
        # the sampler's torch ops then share the forward's OpenMP team. A second team, this
        # thread's, would make libgomp manage more threads than there are cores, and it then
        # stops its idle workers spinning: every parallel op of the next forward wakes them
        # through the kernel (the server's loop thread avoids it the same way, serve/cli.py).
        finishing = self.worker.submit(self._finish, flight, result, forward_ms, out)
        try:
            finishing.result()
        except KeyboardInterrupt:     # Ctrl-C: let the commit end before a reset frees blocks
            wait([finishing])
            raise

    def _finish(self, flight: InFlight, result, forward_ms: float, out: StepOutput) -> None:
        self.bill(out, flight.sched, forward_ms)
        self.scheduler.commit_computed(flight.sched)
        self.finish_step(result, out)

    # --- requests while a forward is in flight ----------------------------------------------------
    def has_unfinished(self) -> bool:
        return super().has_unfinished() or self.in_flight is not None

    def abort(self, request_id: str) -> bool:
        """Cancel a request; while a forward runs, after that step lands (its blocks are being
        written now)."""
        if self.in_flight is None:
            return super().abort(request_id)
        group = self.groups.get(request_id)
        if group is None or group.request.finished or request_id in self.deferred_aborts:
            return False
        self.deferred_aborts.append(request_id)
        return True

    def _apply_deferred_aborts(self, out: StepOutput) -> None:
        for request_id in self.deferred_aborts:
            super().abort(request_id)        # False if it finished in the step that landed
        self.deferred_aborts = []
        out.finished += self.aborted
        self.aborted = []

    def _wait(self) -> None:
        """Let a forward in flight end (its result is dropped: its requests are being reset)."""
        flight, self.in_flight = self.in_flight, None
        if flight is not None:
            try:
                flight.future.result()
            except Exception:            # the run is failing already; the reset goes on
                pass

    def reset(self) -> list[Request]:
        self._wait()
        self.deferred_aborts = []
        return super().reset()

    def close(self) -> None:
        self._wait()
        self.worker.shutdown(wait=True)
        super().close()

    # --- what views may ask -------------------------------------------------------------------------
    def describe(self) -> dict:
        return {**super().describe(), "async_scheduling": True, "overlap": self.overlap.as_dict()}

    def run_extra(self) -> dict:
        return {**super().run_extra(), "overlap": self.overlap.as_dict()}


class AsyncSpeculativeEngine(AsyncEngine, SpeculativeEngine):
    """Rung 6 with rung 12's overlapped step (``speculative=`` + ``async_scheduling=True``):
    ``AsyncEngine._step`` proposes once step N has landed, launches the 1 + k rows of step N + 1,
    and verifies them when they land; nothing of either rung is copied."""

    def __init__(self, model, **options):
        super().__init__(model, **options)
        self.name = f"{self.name}-async"           # paged+ngram-async, paged+draft-async
