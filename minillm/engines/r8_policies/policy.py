"""Rung 8 — scheduling policies beyond first come, first served (notebook 08).

Each is a ``SchedulingPolicy`` of the core (``core/policy.py``: ``key`` and ``preempts``), given
to the paged engine as a component (``PolicyConfig``, ``config.py``). In vLLM's and SGLang's vocabulary (rung 12 adds a fourth, ``slo``: ``engines/r12_realtime/slo.py``):

- ``fcfs``: arrival order; nobody is evicted for a newcomer (vLLM's default).
- ``priority``: lower ``Request.priority`` first, ties by arrival (vLLM's semantics). Unlike
  vLLM's (vllm-project/vllm#40004), a waiting request evicts a running one whose priority value is
  higher by more than ``priority_preemption_threshold`` (SGLang's threshold): an urgent arrival
  does not wait for a full batch to drain. A steady stream of urgent requests starves the others
  for ever: that is what ``score`` fixes.
- ``score``: the background notes' weighted score of user priority, remaining length and waiting
  time, ``key = w_p * priority + w_r * remaining + w_w * arrival_step`` (lower first). Waiting
  time is measured in engine steps, not seconds: it is deterministic, and a step is the unit the
  engine serves in. Every request ages at the same rate, so aging is the arrival step's term:
  ``key(t) = w_p*p + w_r*r - w_w*(t - arrival)`` orders requests exactly as this key does at every
  ``t``. ``remaining`` is what a request can know of itself: ``max_tokens`` minus the tokens its
  furthest sample has generated (no learned length estimate). A running request's key falls as it
  generates, so the request it evicted can never evict it back (no ping-pong); ``score_margin``
  (in key units) keeps near-ties from evicting each other at all.

**Starvation bound under ``score``** (``w_w > 0``). Let request r arrive at step ``a``. Any request
arriving at step ``a' > a + D``, with ``D = (w_p * (p_r - p_min) + w_r * remaining_r + margin) /
w_w`` (``p_min``: the lowest priority value that arrives), has a key greater than r's by more than
the margin, waiting or running, whatever its remaining length (``>= 0``). So after step ``a + D``
nobody new overtakes r, and r may evict any such newcomer for a seat or for blocks: r is admitted
as soon as the requests that arrived by ``a + D`` and rank ahead of it have been admitted — a
fixed, finite set. With seats for S and each of those needing at most L steps (prompt chunks plus
``max_tokens``) in a pool that holds them, r waits at most ``D + ceil(|ahead| / S) * L`` steps
(``tests/rungs/test_r08_policy.py`` checks this bound on an adversarial stream that starves r under
``priority``).

The default weights keep that bound within reach: a priority level is worth 20 steps of waiting
(``w_p = 20``, ``w_w = 1``, ``w_r = 0.1``, margin 10), so a request 10 levels behind a steady
stream of priority-0 requests, with ``max_tokens`` 128, is overtaken by newcomers for at most
``D = (20 * 10 + 0.1 * 128 + 10) / 1 = 222`` steps; under a stream the engine keeps pace with
(|ahead| about D plus the queue it found), its first token comes within a few hundred steps
(``tests/rungs/test_r08_policy.py`` checks it on the step clock). A larger ``score_priority_weight`` keeps
classes apart longer and pushes the bound out with it: at 1000 the same request waits ~10,000
steps, a bound no run reaches.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...checks import check_float
from ...core.policy import FCFS, SchedulingPolicy

if TYPE_CHECKING:
    from ...core.sequence import SequenceGroup

# The largest score weight (SchedulerConfig's options and Score itself are checked against it).
# With priority and max_tokens within int32 (minillm/checks.py), a score is at most
# MAX_SCORE_WEIGHT * (2 * 2**31 + arrival_step) in magnitude, about 4e18 plus the steps: finite,
# so keys always compare and a difference of two is never inf - inf = nan.
MAX_SCORE_WEIGHT = 1e9


@dataclass(frozen=True)
class Priority:
    threshold: int = 0
    name: str = "priority"

    def key(self, group: SequenceGroup) -> tuple:
        return (group.request.priority, group.arrival_index)

    def preempts(self, candidate: SequenceGroup, victim: SequenceGroup) -> bool:
        return victim.request.priority - candidate.request.priority > self.threshold


def remaining_tokens(group: SequenceGroup) -> int:
    """Tokens the request may still generate: ``max_tokens`` minus what its furthest sample has
    (a beam or sample that finished does not count; the group is gone when all have)."""
    generated = max((len(s.output_token_ids) for s in group.seqs), default=0)
    return max(0, group.request.params.max_tokens - generated)


@dataclass(frozen=True)
class Score:
    wait_weight: float = 1.0        # per step of waiting (the arrival step's weight)
    remaining_weight: float = 0.1   # per token still to generate
    priority_weight: float = 20.0   # per unit of Request.priority (= 20 steps of waiting)
    margin: float = 10.0            # a candidate must beat its victim by more than this
    name: str = "score"

    def __post_init__(self):
        for name in ("wait_weight", "remaining_weight", "priority_weight", "margin"):
            value = check_float(name, getattr(self, name))
            top = math.inf if name == "margin" else MAX_SCORE_WEIGHT
            if not 0 <= value <= top:
                raise ValueError(f"score: {name} must be in [0, {top:g}], got {value!r}")

    def score(self, group: SequenceGroup) -> float:
        return (self.priority_weight * group.request.priority
                + self.remaining_weight * remaining_tokens(group)
                + self.wait_weight * group.arrival_step)

    def key(self, group: SequenceGroup) -> tuple:
        return (self.score(group), group.arrival_index)

    def preempts(self, candidate: SequenceGroup, victim: SequenceGroup) -> bool:
        return self.score(victim) - self.score(candidate) > self.margin

    def overtake_horizon(self, group: SequenceGroup, min_priority: int) -> int:
        """``D`` of the starvation bound: no request arriving more than this many steps after
        ``group`` ranks ahead of it (needs ``wait_weight > 0``)."""
        if self.wait_weight <= 0:
            raise ValueError("score: with wait_weight 0 there is no starvation bound")
        head = (self.priority_weight * (group.request.priority - min_priority)
                + self.remaining_weight * remaining_tokens(group) + self.margin)
        return max(0, math.floor(head / self.wait_weight))


NAMED = {"fcfs": FCFS, "priority": Priority, "score": Score}


def get_policy(policy: SchedulingPolicy | str) -> SchedulingPolicy:
    """``policy`` itself, or the policy a name names, with its default weights."""
    if not isinstance(policy, str):
        return policy
    if policy not in NAMED:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(NAMED)}")
    return NAMED[policy]()
