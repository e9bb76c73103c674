"""Adaptive batch size: a controller that sets each step's token budget from measured step times
so that a step — hence the time per output token of every running request — stays within a TPOT
objective, while the batch stays as wide as that allows (rung 12, notebook 12).

A fixed ``max_num_batched_tokens`` / ``max_num_seqs`` is a guess made before the load is known:
too wide and a burst stretches every step (TPOT P99 blows up), too narrow and throughput is left
on the table. On a CPU (and a GPU's decode) a step's time is close to affine in the tokens it
computes, ``t = a + b * n``: a fixed part (weights streamed once, Python, kernel launches) and a
part per token. ``TPOTController`` fits ``a`` and ``b`` by exponentially weighted least squares
(old steps fade: the machine's load changes) and sets the cap to the largest ``n`` whose predicted
time is within the target. A model, not a feedback rule: AIMD's narrow-by-half, widen-by-one
would oscillate around the target for ever; the fit settles on the cap and stays there while the
cost does, and moves (either way) when the cost moves.

While the steps all have the same size (a steady decode batch), ``n`` has no spread and the slope
cannot be told from the fixed part; the fit then falls back to ``b = t / n`` (``a = 0``): at the
cap both rules give the same answer, and with no spread it errs on the narrow side.

The cap is a token budget per step; seats (``max_num_seqs``) follow it, since a seat needs a token
a step. The scheduler never lets it fall below 1, nor below the widest running request (its n
samples or beams decode together): nobody starves. Each change is a ``"controlled"`` observer
event carrying a ``BatchDecision``; ``describe()`` shows the state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

CONTROLLERS = ("none", "tpot")


@dataclass(frozen=True)
class BatchDecision:
    """One change of the cap: what the controller saw and what it concluded."""

    old_cap: int
    new_cap: int
    step_ms: float            # the step just measured
    fixed_ms: float           # the fit's a (ms per step)
    per_token_ms: float       # the fit's b (ms per token)


class BatchController(Protocol):
    name: str
    cap: int | None              # tokens per step (None: the config's limits)

    def observe(self, num_tokens: int, step_ms: float) -> BatchDecision | None: ...

    def describe(self) -> dict: ...


class NoController:
    """The fixed batch: the config's limits, never changed."""

    name = "none"
    cap: int | None = None

    def observe(self, num_tokens: int, step_ms: float) -> BatchDecision | None:
        return None

    def describe(self) -> dict:
        return {"batch_controller": self.name}


class TPOTController:
    """Token budget per step from a fit of step time against tokens (see the module)."""

    name = "tpot"

    def __init__(self, target_ms: float, ceiling: int, alpha: float = 0.3,
                 headroom: float = 0.95):
        """``target_ms``: the TPOT objective; ``ceiling``: the config's budget (never exceeded);
        ``alpha``: weight of the newest step in the fit; ``headroom``: the fraction of the target
        aimed at (steps vary a little around the fit)."""
        if not (math.isfinite(target_ms) and target_ms > 0):
            raise ValueError(f"tpot_target_ms must be > 0, got {target_ms!r}")
        self.target_ms, self.ceiling = float(target_ms), int(ceiling)
        self.alpha, self.headroom = alpha, headroom
        self.cap = self.ceiling           # wide until a step says otherwise
        self.moments: tuple[float, float, float, float] | None = None  # E[n], E[t], E[n²], E[nt]
        self.fit = (0.0, 0.0)             # (a, b)

    def observe(self, num_tokens: int, step_ms: float) -> BatchDecision | None:
        """Fold in one step (``num_tokens`` computed in ``step_ms``); a decision if the cap moved."""
        if num_tokens <= 0 or not math.isfinite(step_ms) or step_ms < 0:
            return None
        n, t = float(num_tokens), float(step_ms)
        new = (n, t, n * n, n * t)
        if self.moments is None:
            self.moments = new
        else:
            self.moments = tuple(m + self.alpha * (x - m) for m, x in zip(self.moments, new))
        self.fit = self._fit()
        old, new = self.cap, self._cap()
        # narrow at once (the objective is at stake); widen only by more than a token or 2%: a
        # fit that wobbles in its last digit must not move the batch back and forth
        if new == old or old < new <= old + max(1, old // 50):
            return None
        self.cap = new
        return BatchDecision(old, self.cap, t, *self.fit)

    def _fit(self) -> tuple[float, float]:
        """(a, b) of ``t = a + b n``; ``b = t / n`` when the steps' sizes have no spread."""
        mn, mt, mnn, mnt = self.moments
        var = mnn - mn * mn
        if var > 1.0:                     # at least a token of spread
            b = (mnt - mn * mt) / var
            a = mt - b * mn
            if b > 0 and a >= 0:
                return a, b
        return 0.0, mt / mn

    def _cap(self) -> int:
        a, b = self.fit
        aim = self.target_ms * self.headroom
        if b <= 0:
            return self.ceiling
        # (+1e-9: a fit exact but for its last bit must not lose a token to the floor)
        return int(max(1, min(self.ceiling, math.floor((aim - a) / b + 1e-9))))

    def describe(self) -> dict:
        a, b = self.fit
        return {"batch_controller": self.name, "tpot_target_ms": self.target_ms,
                "batch_cap": self.cap, "step_fixed_ms": round(a, 3),
                "step_per_token_ms": round(b, 4)}


def make_controller(config) -> NoController | TPOTController:
    """The controller a ``SchedulerConfig`` names (``batch_controller``, ``tpot_target_ms``)."""
    if config.batch_controller == "tpot":
        return TPOTController(config.tpot_target_ms, config.max_num_batched_tokens)
    return NoController()
