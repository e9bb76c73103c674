"""Run a workload through the fragmentation visualizer's allocators, no model needed.

Memory waste in a KV cache depends only on *who holds which slots when*, not on what the model
computes. So a workload (``minillm/workload.py``) runs through three allocators with a fake model step
(every scheduled token is "computed" instantly, every sequence that reaches its end "samples" a
token), and each step records how the memory is used (``accounting.py``). Hundreds of steps take a
fraction of a second, which is what lets notebook 05 (``05_fragmentation_visualizer``) re-run
everything whenever a slider moves. The three allocators, all given the same ``budget_slots``:

* ``max-length`` and ``exact``: ``ContiguousSim`` (``contiguous.py``), one contiguous region per
  sequence, reserved up front;
* ``paged``: ``PagedReplay`` (``paged_replay.py``), the real ``PagedEngine`` computing nothing.

``simulate`` serves a workload with one of them, ``compare`` with all of them at one budget.
"""
from __future__ import annotations

from collections import deque

from .accounting import ALLOCATORS, SimConfig, SimResult
from .contiguous import ContiguousSim
from .paged_replay import PagedReplay
from ..workload import SimRequest


def make_allocator(name: str, cfg: SimConfig, requests: list[SimRequest]):
    if name == "paged":
        return PagedReplay(cfg)
    if name in ("max-length", "exact"):
        max_len = cfg.max_len or max((r.prompt_len + r.max_tokens for r in requests), default=1)
        return ContiguousSim(cfg, name, max_len)
    raise ValueError(f"unknown allocator {name!r}: choose one of {', '.join(ALLOCATORS)}")


def simulate(requests: list[SimRequest], allocator: str = "paged", config: SimConfig | None = None,
             max_steps: int = 100_000) -> SimResult:
    """Serve ``requests`` with ``allocator``; one ``SimStep`` (and snapshot) per engine step.

    Mirrors ``Engine.run``: before each step, every request whose ``arrival_step`` has come is
    added (in list order among equals); a request that could never fit the budget alone is
    rejected, as the engines reject it. With ``config.idle_steps`` an empty system still ticks
    (synthetic timelines where arrival steps are clock time); without it, like the engine, it
    jumps to the next arrival without recording a step.
    """
    cfg = config or SimConfig()
    alloc = make_allocator(allocator, cfg, requests)
    pending = deque(sorted(requests, key=lambda r: r.arrival_step))
    steps, snaps, rejected = [], [], []
    clock = 0
    while pending or alloc.has_unfinished():
        while pending and pending[0].arrival_step <= clock:
            r = pending.popleft()
            # a contiguous allocator must always turn away what can never fit: it would wait forever
            if (allocator == "paged" and not cfg.validate) or alloc.fits(r):
                alloc.add(r)
            else:
                rejected.append(r.request_id)
        if not alloc.has_unfinished():
            if pending and not cfg.idle_steps:
                clock = pending[0].arrival_step
                continue
            if not pending:
                break
        if len(steps) >= max_steps:
            raise RuntimeError(f"{allocator}: not done after {max_steps} steps")
        if alloc.has_unfinished():
            alloc.step()
        clock += 1
        rec, snap = alloc.measure(len(steps) + 1)
        steps.append(rec)
        if snap is not None:
            snaps.append(snap)
    return SimResult(allocator, cfg, steps, snaps, len(requests), rejected)


def compare(requests: list[SimRequest], config: SimConfig | None = None,
            allocators: tuple[str, ...] = ALLOCATORS) -> dict[str, SimResult]:
    """The same workload through every allocator at the same budget."""
    return {a: simulate(requests, a, config) for a in allocators}
