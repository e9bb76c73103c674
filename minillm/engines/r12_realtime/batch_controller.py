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
cannot be told from the fixed part; the fit then keeps the fixed part it last knew (0 if it never
saw a spread) and solves the slope through the mean step, ``b = (t - a) / n``: at the cap every
such rule gives the same answer, and with no spread ever seen it errs on the narrow side.
(Forgetting ``a`` there made the "widen" rule below swing between two caps: with ``a = 0`` a wider
batch serves no more tokens per ms.)

The cap is a token budget per step; seats (``max_num_seqs``) follow it, since a seat needs a token
a step. The scheduler never lets it fall below 1, nor below the widest running request (its n
samples or beams decode together): nobody starves. Each change is a ``"controlled"`` observer
event carrying a ``BatchDecision``; ``describe()`` shows the state.

The arrival rate is the other input (``LoadAwareController``, what ``batch_controller="tpot"``
builds; ``Demand``): arrivals per second on the scheduler's clock
times the work a request brings (tokens computed by the requests that finished; before any has,
what the arrivals may bring at most). Divided by what
the objective's batch serves, ``cap / t(cap)`` tokens per ms, it is the ``load``: above 1 the
arrivals outrun the objective and the queue grows for as long as they do. Below 1 the cap hardly
ever binds (the batch is narrower than it), so the rate changes nothing there. Above 1 no batch
size holds both the objective and a bounded queue, and ``overload`` says which gives:
``"hold"`` (the default) keeps the objective and lets requests wait (TTFT pays); ``"widen"``
widens to the narrowest batch that keeps up with the arrivals, ``n / t(n) >= 1.1 x demand``
(TPOT pays, as little as the arrivals force).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ...core.budget import FixedBatch

CONTROLLERS = ("none", "tpot")
OVERLOAD = ("hold", "widen")
KEEP_UP = 1.1           # "widen" aims at serving this much more than the arrivals bring


@dataclass(frozen=True)
class BatchDecision:
    """One change of the cap: what the controller saw and what it concluded."""

    old_cap: int
    new_cap: int
    step_ms: float            # the step just measured
    fixed_ms: float           # the fit's a (ms per step)
    per_token_ms: float       # the fit's b (ms per token)
    load: float | None = None     # arrivals' work / what the objective's batch serves


class Demand:
    """The work arriving per ms: an arrival rate that fades with ``tau_ms`` (each arrival adds
    ``1 / tau``, and the sum decays as ``exp(-dt / tau)``: a burst shows within a few arrivals
    and is forgotten within a few ``tau``) times the tokens a request brings: a moving average of
    the finished ones' (prompt and output, every sample), and until one has finished the
    arrivals' upper bound (prompt + n x ``max_tokens``, which a chat answer seldom reaches)."""

    def __init__(self, tau_ms: float = 2000.0, alpha: float = 0.2):
        self.tau_ms, self.alpha = tau_ms, alpha
        self.rate, self.at_ms = 0.0, 0.0          # arrivals per ms, as of ``at_ms``
        self.tokens: float | None = None          # of finished requests
        self.bound: float | None = None           # of arrivals, at most

    def arrived(self, now_ms: float, at_most: int) -> None:
        self.rate, self.at_ms = self.rate_at(now_ms) + 1.0 / self.tau_ms, max(now_ms, self.at_ms)
        self.bound = self._average(self.bound, at_most)

    def finished(self, num_tokens: int) -> None:
        self.tokens = self._average(self.tokens, num_tokens)

    def _average(self, mean: float | None, x: int) -> float:
        return float(x) if mean is None else mean + self.alpha * (x - mean)

    def rate_at(self, now_ms: float) -> float:
        """Arrivals per ms at ``now_ms``."""
        return self.rate * math.exp(-max(0.0, now_ms - self.at_ms) / self.tau_ms)

    def per_ms(self, now_ms: float) -> float | None:
        """Tokens of work arriving per ms (None before any arrival)."""
        tokens = self.tokens if self.tokens is not None else self.bound
        return None if tokens is None else self.rate_at(now_ms) * tokens


class TPOTController(FixedBatch):
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
        """(a, b) of ``t = a + b n``; with no spread of sizes, the last ``a`` and the mean step."""
        mn, mt, mnn, mnt = self.moments
        var = mnn - mn * mn
        if var > 1.0:                     # at least a token of spread
            b = (mnt - mn * mt) / var
            a = mt - b * mn
            if b > 0 and a >= 0:
                return a, b
        a = self.fit[0] if self.fit[0] < mt else 0.0
        return a, (mt - a) / mn

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


class LoadAwareController(TPOTController):
    """The TPOT controller told of arrivals (``--batch-controller tpot``): the load beside the
    fit, and under ``overload="widen"`` the narrowest batch that keeps up with the arrivals where
    the target's does not (see the module)."""

    def __init__(self, target_ms: float, ceiling: int, overload: str = "hold", **fit):
        if overload not in OVERLOAD:
            raise ValueError(f"tpot_overload must be 'hold' or 'widen', got {overload!r}")
        super().__init__(target_ms, ceiling, **fit)
        self.overload = overload
        self.demand, self.now_ms = Demand(), 0.0    # the clock: the steps' times, summed
        self.load: float | None = None
        self.spread_seen = False    # a least-squares fit, not the fallback, stands behind (a, b)

    def arrived(self, now_ms: float, at_most: int) -> None:
        self.demand.arrived(now_ms, at_most)

    def finished(self, num_tokens: int) -> None:
        self.demand.finished(num_tokens)

    def observe(self, num_tokens: int, step_ms: float) -> BatchDecision | None:
        if num_tokens > 0 and math.isfinite(step_ms) and step_ms >= 0:
            self.now_ms += step_ms
        decision = super().observe(num_tokens, step_ms)
        return decision and dataclasses.replace(decision, load=self.load)

    def _cap(self) -> int:
        """The target's cap; wider under "widen" when the arrivals outrun it."""
        cap = super()._cap()
        a, b = self.fit
        mn, _, mnn, _ = self.moments
        # until the steps' sizes have had a spread the fit is b = t / n, all of a step's time put
        # on its tokens: light steps then look as if every token cost a whole step, and the load
        # of a few requests would read as an overload. No load is claimed before then.
        self.spread_seen = self.spread_seen or mnn - mn * mn > 1.0
        demand = self.demand.per_ms(self.now_ms) if self.spread_seen else None
        self.load = None if demand is None else demand * (a + b * cap) / cap
        if self.overload == "widen" and self.load is not None and self.load > 1.0:
            cap = max(cap, self._keeping_up(demand * KEEP_UP))
        return cap

    def _keeping_up(self, per_ms: float) -> int:
        """The narrowest budget ``n`` that serves ``per_ms`` tokens per ms: ``n / (a + b n) >=
        per_ms``, i.e. ``n >= per_ms a / (1 - per_ms b)``; the ceiling if none does."""
        a, b = self.fit
        if per_ms * b >= 1.0:
            return self.ceiling
        return int(min(self.ceiling, math.ceil(per_ms * a / (1.0 - per_ms * b) - 1e-9)))

    def describe(self) -> dict:
        return {**super().describe(), "tpot_overload": self.overload,
                "arrivals_per_s": round(self.demand.rate_at(self.now_ms) * 1000.0, 3),
                "load": None if self.load is None else round(self.load, 3)}
