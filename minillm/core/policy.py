"""Scheduling policies: who is admitted first, and who may be evicted for whom (notebook 08).

The scheduler asks its policy two questions, and nothing else:

- ``key(group)``: a sort key, lower first. The waiting queue is admitted in this order, and the
  running request with the highest key is the first preempted when memory runs out. A waiting
  request's key must not change while it waits: the scheduler inserts each arrival at its place
  in a queue it never re-sorts (``Scheduler.add``). All three keys below read only what is fixed
  while a request waits (its arrival, ``priority``, ``max_tokens``, and the tokens it generated
  before a preemption: tokens land only for running requests). It must also never raise: every
  integer a request carries is bounded (``minillm/checks.py``) and so are the weights
  (``MAX_SCORE_WEIGHT``), so every key is finite (``tests/test_policy.py`` checks the extremes);
  a key that raises anyway fails its own request at admission (``Scheduler.add``), no other.
- ``preempts(candidate, victim)``: may a waiting ``candidate`` that cannot be seated (the batch is
  full at ``max_num_seqs``, or the pool has no blocks for it) evict the running ``victim``? The
  victim is recompute-preempted (its KV freed, its tokens kept) and waits again.

Four policies, in vLLM's and SGLang's vocabulary (``slo`` is rung 12's, notebook 12):

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

- ``slo``: earliest deadline first. A request's deadline is that of its next token on the
  scheduler's clock (``Scheduler.now_ms``: the sum of the step times it was told, so a run billed
  by a cost model is the same on every machine): ``arrival_ms + ttft + tpot * generated``, with
  the request's objectives (``Request.ttft_slo_ms``/``tpot_slo_ms``, the HTTP fields of the same
  names) or the config's defaults for those it lacks. Fixed while it waits (tokens land only for
  running requests); a running request's deadline moves on by ``tpot`` per token, so one on
  schedule ranks behind a newcomer whose first token is due. A request that has produced no
  token yet (its TTFT is at stake) evicts a running one whose deadline is later by more than
  ``margin_ms``; a request that has tokens evicts nobody, so an eviction can be answered by at
  most one eviction back (the victim had no token yet either), never a ping-pong.

**Starvation bound under ``slo``.** Every deadline is at least its arrival plus ``ttft_min`` (the
smallest TTFT objective that arrives, ``>= 0``). So a request arriving more than ``D =
deadline_r - arrival_r + margin - ttft_min`` ms after r has a deadline later than r's by more than
the margin: it never overtakes r, and r may evict it. As under ``score``, r then waits at most for
the fixed set that arrived by ``arrival_r + D`` and ranks ahead of it (``overtake_horizon_ms``;
``tests/test_slo_policy.py`` checks it on random streams).

**Starvation bound under ``score``** (``w_w > 0``). Let request r arrive at step ``a``. Any request
arriving at step ``a' > a + D``, with ``D = (w_p * (p_r - p_min) + w_r * remaining_r + margin) /
w_w`` (``p_min``: the lowest priority value that arrives), has a key greater than r's by more than
the margin, waiting or running, whatever its remaining length (``>= 0``). So after step ``a + D``
nobody new overtakes r, and r may evict any such newcomer for a seat or for blocks: r is admitted
as soon as the requests that arrived by ``a + D`` and rank ahead of it have been admitted — a
fixed, finite set. With seats for S and each of those needing at most L steps (prompt chunks plus
``max_tokens``) in a pool that holds them, r waits at most ``D + ceil(|ahead| / S) * L`` steps
(``tests/test_policy.py`` checks this bound on an adversarial stream that starves r under
``priority``).

The default weights keep that bound within reach: a priority level is worth 20 steps of waiting
(``w_p = 20``, ``w_w = 1``, ``w_r = 0.1``, margin 10), so a request 10 levels behind a steady
stream of priority-0 requests, with ``max_tokens`` 128, is overtaken by newcomers for at most
``D = (20 * 10 + 0.1 * 128 + 10) / 1 = 222`` steps; under a stream the engine keeps pace with
(|ahead| about D plus the queue it found), its first token comes within a few hundred steps
(``tests/test_policy.py`` checks it on the step clock). A larger ``score_priority_weight`` keeps
classes apart longer and pushes the bound out with it: at 1000 the same request waits ~10,000
steps, a bound no run reaches.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..checks import check_float

if TYPE_CHECKING:
    from ..request import Request
    from .config import SchedulerConfig
    from .sequence import SequenceGroup

# The largest score weight (SchedulerConfig's options and Score itself are checked against it).
# With priority and max_tokens within int32 (minillm/checks.py), a score is at most
# MAX_SCORE_WEIGHT * (2 * 2**31 + arrival_step) in magnitude, about 4e18 plus the steps: finite,
# so keys always compare and a difference of two is never inf - inf = nan.
MAX_SCORE_WEIGHT = 1e9


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


# The largest SLO objective or margin in ms (a year): keeps every deadline finite and exact.
MAX_SLO_MS = 3.2e10
SLO_FIELDS = ("ttft_slo_ms", "tpot_slo_ms")


def check_slo_ms(name: str, value) -> float:
    """An objective in ms: a finite number in (0, MAX_SLO_MS] (a ValueError naming it)."""
    value = check_float(name, value)
    if not 0 < value <= MAX_SLO_MS:
        raise ValueError(f"{name} must be in (0, {MAX_SLO_MS:g}] ms, got {value!r}")
    return value


def parse_slo_classes(text: str | None) -> tuple[tuple[int, float, float], ...]:
    """``slo_classes``, ``"P:TTFT:TPOT,..."`` (``;`` separates too): the objectives (ms) of a
    request of priority P that names none of its own, e.g. ``"0:1000:100,1:20000:500"``
    (interactive and batch told apart by their priority). A ValueError naming the wrong item."""
    if text is None or not str(text).strip():
        return ()
    if not isinstance(text, str):
        raise ValueError(f"slo_classes must be a string 'P:TTFT_MS:TPOT_MS,...', got {text!r}")
    out: list[tuple[int, float, float]] = []
    for item in re.split(r"[,;]", text):       # ';' too: a bench --serve name is comma-separated
        parts = item.strip().split(":")
        try:
            if len(parts) != 3:
                raise ValueError("three fields")
            priority = int(parts[0])
            ttft, tpot = (check_slo_ms(n, float(v)) for n, v in zip(("TTFT", "TPOT"), parts[1:]))
        except ValueError as e:
            raise ValueError(f"slo_classes: {item.strip()!r} is not PRIORITY:TTFT_MS:TPOT_MS "
                             f"with objectives in (0, {MAX_SLO_MS:g}] ms ({e})") from None
        if any(p == priority for p, _, _ in out):
            raise ValueError(f"slo_classes: priority {priority} is given twice")
        out.append((priority, ttft, tpot))
    return tuple(out)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 1000.0          # objective of a request that names none, nor has a class
    tpot_ms: float = 100.0
    margin_ms: float = 100.0         # a candidate's deadline must be earlier by more than this
    name: str = "slo"
    # (priority, TTFT, TPOT): a class's objectives, for its requests that name none
    classes: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self):
        for name in ("ttft_ms", "tpot_ms"):
            check_slo_ms(name, getattr(self, name))
        if not 0 <= check_float("margin_ms", self.margin_ms) <= MAX_SLO_MS:
            raise ValueError(f"slo: margin_ms must be in [0, {MAX_SLO_MS:g}], got "
                             f"{self.margin_ms!r}")
        for _, ttft, tpot in self.classes:
            check_slo_ms("a class's TTFT", ttft), check_slo_ms("a class's TPOT", tpot)

    def objectives(self, req: Request) -> tuple[float, float]:
        """(TTFT, TPOT) objectives in ms, each the request's own, else its priority class's,
        else this policy's defaults."""
        ttft, tpot = next(((t, s) for p, t, s in self.classes if p == req.priority),
                          (self.ttft_ms, self.tpot_ms))
        return (ttft if req.ttft_slo_ms is None else req.ttft_slo_ms,
                tpot if req.tpot_slo_ms is None else req.tpot_slo_ms)

    def deadline(self, group: SequenceGroup) -> float:
        """When the request's next token is due, on the scheduler's clock (ms)."""
        ttft, tpot = self.objectives(group.request)
        generated = max((len(s.output_token_ids) for s in group.seqs), default=0)
        return group.arrival_ms + ttft + tpot * generated

    def key(self, group: SequenceGroup) -> tuple:
        return (self.deadline(group), group.arrival_index)

    def preempts(self, candidate: SequenceGroup, victim: SequenceGroup) -> bool:
        started = any(s.output_token_ids for s in candidate.seqs)
        return not started and self.deadline(victim) - self.deadline(candidate) > self.margin_ms

    def overtake_horizon_ms(self, group: SequenceGroup, min_ttft_ms: float = 0.0) -> float:
        """``D`` of the starvation bound: nobody arriving more than this many ms after ``group``
        ranks ahead of it or may evict it."""
        return max(0.0, self.deadline(group) - group.arrival_ms + self.margin_ms - min_ttft_ms)


NAMED = {"fcfs": FCFS, "priority": Priority, "score": Score, "slo": SLO}
POLICIES = tuple(NAMED)


def get_policy(policy: SchedulingPolicy | str) -> SchedulingPolicy:
    """``policy`` itself, or the policy a name names, with its default weights."""
    if not isinstance(policy, str):
        return policy
    if policy not in NAMED:
        raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
    return NAMED[policy]()


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy ``config.policy`` names, with the config's weights."""
    if config.policy == "priority":
        return Priority(config.priority_preemption_threshold)
    if config.policy == "score":
        return Score(config.score_wait_weight, config.score_remaining_weight,
                     config.score_priority_weight, config.score_margin)
    if config.policy == "slo":
        return SLO(config.slo_ttft_ms, config.slo_tpot_ms, config.slo_margin_ms,
                   classes=parse_slo_classes(config.slo_classes))
    return FCFS()


POLICY_FIELDS = ("priority_preemption_threshold", "score_wait_weight", "score_remaining_weight",
                 "score_priority_weight", "score_margin", "slo_ttft_ms", "slo_tpot_ms",
                 "slo_margin_ms", "slo_classes")


def policy_options(config: SchedulerConfig) -> dict:
    """The config's policy weights that differ from their defaults (what a trace keeps)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return {k: getattr(config, k) for k in POLICY_FIELDS if getattr(config, k) != defaults[k]}
