"""When a step that schedules nothing is a bug (notebook 03's livelock check).

A step may schedule nothing while requests wait for memory that running ones hold, or when all
it did was end aborted requests. It is a bug when the pool is empty and the queue still is not
(the queue's head alone always fits: checked on arrival), or when it goes on for
``MAX_IDLE_STEPS`` steps in a row: raised as a RuntimeError, never a hang.
"""
from __future__ import annotations

MAX_IDLE_STEPS = 64     # steps in a row that schedule nothing before the engine calls it a livelock


class IdleSteps:
    """Counts the steps in a row that scheduled nothing while requests were in the engine."""

    def __init__(self):
        self.last, self.run = -2, 0     # the latest idle step's number, idle steps in a row

    def check(self, scheduler, ended_some: bool, step: int) -> None:
        """``step`` scheduled nothing (``ended_some``: it ended aborted requests)."""
        running, waiting = scheduler.running, scheduler.waiting
        if not running and waiting and not ended_some:
            raise RuntimeError("scheduler made no progress with an empty pool (a bug)")
        stuck = bool(running or waiting) and not ended_some
        self.run = self.run + 1 if stuck and self.last == step - 1 else int(stuck)
        self.last = step
        if self.run >= MAX_IDLE_STEPS:
            self.last, self.run = -2, 0
            raise RuntimeError(
                f"the scheduler scheduled nothing for {MAX_IDLE_STEPS} steps in a row while "
                f"{len(running)} requests run and {len(waiting)} wait: no progress "
                "(does preempt free the blocks? do a preempted request's samples adopt its prompt "
                "again, _readopt_prompt?)")
