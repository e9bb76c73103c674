"""Rung 12's overlapped step: ``async_scheduling=True`` (vLLM's name; notebook 12).

The core's step is strictly serial: schedule, forward, sample, commit — then the caller (the
driver, a server's loop) detokenizes and streams what finished, records the step, admits new
requests, and only then does the next step start. ``async_scheduling=True`` plugs a
``ThreadExecutor`` into the core's step loop (``core/executor.py``: depth 1, one ahead), and each
``step()`` then

1. waits for the forward launched by the previous ``step()`` (step N) and lands it — its time
   recorded, its K/V committed, its tokens sampled and committed — exactly as the core does;
2. schedules step N + 1 on that committed state and launches its forward on the worker thread;
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
so tokens (greedy and seeded), preemption, n > 1, beams, prefix caching and speculative decoding
are the synchronous engine's by construction (``tests/rungs/test_r12_async_scheduling.py`` checks it);
what overlaps is the host work outside the engine. Notebook 12 measures how much that is.

Nothing the forward reads may change while it runs: new requests only join the waiting queue,
an abort of a request in the step in flight is applied once that step has landed, and a reset
waits for the forward first (the core's loop does all three, for rung 7's micro-batches too).
Pipeline and tensor parallelism and disaggregation keep their own executors: the option is not
theirs.
"""
from __future__ import annotations

import ctypes
import functools
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch



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


class ThreadExecutor:
    """Forwards on one worker thread, the next step launched as soon as one lands (depth 1, one
    ahead): the step loop is the core's (``core/executor.py``); this is the difference."""

    depth, ahead = 1, 1

    def __init__(self):
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-forward")
        self.overlap = Overlap()

    def submit(self, fn, *args) -> Future:
        # the worker computes on as many threads as the thread that steps the engine would, and
        # in the only team: the caller's idle threads go first
        release_idle_openmp_threads()
        return self.worker.submit(self._on_worker, torch.get_num_threads(), fn, *args)

    @staticmethod
    def _on_worker(threads: int, fn, *args):
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return fn(*args)

    def wait(self, future: Future):
        """The forward's (result, ms); a forward's exception is raised here. Ctrl-C while waiting
        leaves it in flight, for the engine's ``reset`` to wait for."""
        t = time.perf_counter()
        result, forward_ms = future.result()
        self.overlap.waited_ms += (time.perf_counter() - t) * 1000.0
        self.overlap.forward_ms += forward_ms
        self.overlap.steps += 1
        return result, forward_ms

    def call(self, fn, *args):
        """Run ``fn`` on the forward's thread while this one waits (nothing runs beside it): the
        sampler's torch ops then share the forward's OpenMP team. A second team, this thread's,
        would make libgomp manage more threads than there are cores, and it then stops its idle
        workers spinning: every parallel op of the next forward wakes them through the kernel
        (the server's loop thread avoids it the same way, serve/cli.py)."""
        done = self.worker.submit(fn, *args)
        try:
            return done.result()
        except KeyboardInterrupt:     # Ctrl-C: let the commit end before a reset frees blocks
            wait([done])
            raise

    def close(self) -> None:
        self.worker.shutdown(wait=True)

    def describe(self) -> dict:
        return {"async_scheduling": True, "overlap": self.overlap.as_dict()}
