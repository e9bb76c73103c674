"""Rung 12's deadline policy ``slo`` (notebook 12): a ``SchedulingPolicy`` of the core
(``core/policy.py``) on the scheduler's clock.

- ``slo``: earliest deadline first. A request's deadline is that of its next token on the
  scheduler's clock (``Scheduler.now_ms``: the sum of the step times it was told, so a run timed
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
``tests/rungs/test_r12_slo_policy.py`` checks it on random streams).

**Starvation bound under ``slo``.** Every deadline is at least its arrival plus ``ttft_min`` (the
smallest TTFT objective that arrives, ``>= 0``). So a request arriving more than ``D =
deadline_r - arrival_r + margin - ttft_min`` ms after r has a deadline later than r's by more than
the margin: it never overtakes r, and r may evict it. As under ``score``, r then waits at most for
the fixed set that arrived by ``arrival_r + D`` and ranks ahead of it (``overtake_horizon_ms``;
``tests/rungs/test_r12_slo_policy.py`` checks it on random streams).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...checks import check_float

if TYPE_CHECKING:
    from ...core.sequence import SequenceGroup
    from ...request import Request

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
        own = [None if getattr(req, f) is None else check_slo_ms(f, getattr(req, f))
               for f in SLO_FIELDS]     # a bad one: the request alone is refused (Scheduler.add)
        return (ttft if own[0] is None else own[0], tpot if own[1] is None else own[1])

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
