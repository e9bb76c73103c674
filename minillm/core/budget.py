"""The step's token budget: the ``SchedulerConfig``'s limits, fixed (notebook 03), or narrowed
each step by a controller that learns from the steps' times (rung 12's adaptive batch,
``engines/r12_realtime/batch_controller.py``), given to the scheduler as ``controller``.

The scheduler tells its controller three things, and asks it one: each step's tokens and time
(``observe``: a decision to show observers, or None), each arrival (``arrived``: the scheduler's
clock and the most work the request may bring) and each finished request's work (``finished``);
``cap`` is the tokens a step may hold now (None: the config's limits). A cap never starves a
request: the scheduler never goes below 1, nor below the widest running request's samples.
"""
from __future__ import annotations

from typing import Protocol


class BatchController(Protocol):
    name: str
    cap: int | None              # tokens per step (None: the config's limits)

    def observe(self, num_tokens: int, step_ms: float) -> object | None: ...

    def arrived(self, now_ms: float, at_most: int) -> None: ...   # joined, with <= this work

    def finished(self, num_tokens: int) -> None: ...       # a request ended: its work in tokens

    def describe(self) -> dict: ...


class FixedBatch:
    """The config's limits, never changed: nothing learned from a step or an arrival."""

    name = "none"
    cap: int | None = None

    def observe(self, num_tokens: int, step_ms: float) -> object | None:
        return None

    def arrived(self, now_ms: float, at_most: int) -> None:
        pass

    def finished(self, num_tokens: int) -> None:
        pass

    def describe(self) -> dict:
        return {"batch_controller": self.name}
