"""Scheduling policies: who is admitted first, and who may be evicted for whom (notebook 08).

The scheduler asks its policy two questions, and nothing else:

- ``key(group)``: a sort key, lower first. The waiting queue is admitted in this order, and the
  running request with the highest key is the first preempted when memory runs out. A waiting
  request's key must not change while it waits: the scheduler inserts each arrival at its place
  in a queue it never re-sorts (``Scheduler.add``). The keys of rung 8's policies (``engines/r8_policies``) read only what is fixed
  while a request waits (its arrival, ``priority``, ``max_tokens``, and the tokens it generated
  before a preemption: tokens land only for running requests). It must also never raise: every
  integer a request carries is bounded (``minillm/checks.py``) and so are the weights
  (``MAX_SCORE_WEIGHT``), so every key is finite (``tests/rungs/test_r08_policy.py`` checks the extremes);
  a key that raises anyway fails its own request at admission (``Scheduler.add``), no other.
- ``preempts(candidate, victim)``: may a waiting ``candidate`` that cannot be seated (the batch is
  full at ``max_num_seqs``, or the pool has no blocks for it) evict the running ``victim``? The
  victim is recompute-preempted (its KV freed, its tokens kept) and waits again.

The core's own policy is ``fcfs``: arrival order, nobody evicted for a newcomer (vLLM's default).
Rung 8 adds ``priority`` and ``score``, rung 12 ``slo``: each a component the engine is given
(``PagedEngine(policy=...)``; the registry builds it from the ``policy`` option).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .sequence import SequenceGroup


class SchedulingPolicy(Protocol):
    name: str

    def key(self, group: SequenceGroup) -> tuple: ...

    def preempts(self, candidate: SequenceGroup, victim: SequenceGroup) -> bool: ...


@dataclass(frozen=True)
class FCFS:
    name: str = "fcfs"

    def key(self, group: SequenceGroup) -> tuple:
        return (group.arrival_index,)

    def preempts(self, candidate: SequenceGroup, victim: SequenceGroup) -> bool:
        return False
