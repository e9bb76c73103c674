"""Rung 12's options (notebook 12), each plugging a component into the paged engine
(``components``): ``RealtimeConfig`` the deadline policy ``slo`` (``slo.py``) and the adaptive
batch (``batch_controller.py``), both on the scheduler's clock; ``AsyncConfig`` the
``ThreadExecutor`` (``engine.py``: forwards on a worker thread, the next step launched as soon as
one lands)."""
from __future__ import annotations

from dataclasses import dataclass

from ...checks import check_float
from ...runtime.config import check_bool, option
from .batch_controller import CONTROLLERS, OVERLOAD, LoadAwareController
from .slo import MAX_SLO_MS, SLO, check_slo_ms, parse_slo_classes

# The smallest tpot_target_ms: no engine step takes less than 0.1 ms on any device (the
# scheduler's Python, a forward's kernel launches and sampling each take tens of microseconds or
# more), so a smaller target could never be met and the controller would hold the batch at one
# token forever.
MIN_TPOT_TARGET_MS = 0.1


@dataclass(frozen=True)
class RealtimeConfig:
    """Deadlines and the adaptive batch: they read each step's time, so only an engine whose steps
    run one at a time takes them."""

    slo_ttft_ms: float = option(
        1000.0, "paged, policy=slo: the TTFT objective (ms) of a request that names none")
    slo_tpot_ms: float = option(
        100.0, "paged, policy=slo: the TPOT objective (ms) of a request that names none")
    slo_classes: str | None = option(
        None, "paged, policy=slo: objectives by request priority for requests that name none, "
              "'P:TTFT_MS:TPOT_MS,...' (or ';'; e.g. '0:1000:100,1:20000:500'); other "
              "priorities get slo_ttft_ms / slo_tpot_ms")
    slo_margin_ms: float = option(
        100.0, "paged, policy=slo: a request with no token yet evicts a running one only if its "
               "deadline is earlier by more than this (ms)")
    batch_controller: str = option(
        "none", "paged: none (fixed limits) or tpot (the token budget per step follows the "
                "measured step time to hold tpot_target_ms; engines/r12_realtime)")
    tpot_target_ms: float = option(
        100.0, "paged, batch_controller=tpot: the step time (= TPOT) to hold (ms)")
    tpot_overload: str = option(
        "hold", "paged, batch_controller=tpot: when arrivals bring more work than the target's "
                "batch serves: hold (keep the target; requests wait) or widen (the narrowest "
                "batch that keeps up; TPOT grows)")

    def __post_init__(self):
        for name in ("slo_ttft_ms", "slo_tpot_ms", "tpot_target_ms"):
            object.__setattr__(self, name, check_slo_ms(name, getattr(self, name)))
        if self.tpot_target_ms < MIN_TPOT_TARGET_MS:
            raise ValueError(f"tpot_target_ms must be >= {MIN_TPOT_TARGET_MS:g} ms (no step is "
                             f"faster), got {self.tpot_target_ms!r}")
        parse_slo_classes(self.slo_classes)          # a ValueError naming the bad item
        margin = check_float("slo_margin_ms", self.slo_margin_ms)
        if not 0 <= margin <= MAX_SLO_MS:
            raise ValueError(f"slo_margin_ms must be in [0, {MAX_SLO_MS:g}], got {margin!r}")
        object.__setattr__(self, "slo_margin_ms", margin)
        if self.batch_controller not in CONTROLLERS:
            raise ValueError(f"unknown batch_controller {self.batch_controller!r}: choose "
                             f"{' or '.join(map(repr, CONTROLLERS))}")
        if self.tpot_overload not in OVERLOAD:
            raise ValueError(f"unknown tpot_overload {self.tpot_overload!r}: choose "
                             f"{' or '.join(map(repr, OVERLOAD))}")

    def components(self, configs: dict) -> dict:
        """``policy=SLO`` when the engine's ``policy`` option says ``slo``; ``controller=`` the
        adaptive batch when ``batch_controller="tpot"`` (its ceiling: the step's token budget)."""
        out = {}
        policy = configs.get("policy_config")
        if policy is not None and policy.policy == "slo":
            out["policy"] = self.slo()
        if self.batch_controller == "tpot":
            ceiling = configs["scheduler_config"].max_num_batched_tokens
            out["controller"] = LoadAwareController(self.tpot_target_ms, ceiling,
                                                    self.tpot_overload)
        return out

    def slo(self) -> SLO:
        return SLO(self.slo_ttft_ms, self.slo_tpot_ms, self.slo_margin_ms,
                   classes=parse_slo_classes(self.slo_classes))


@dataclass(frozen=True)
class AsyncConfig:
    async_scheduling: bool = option(
        False, "paged: overlap the next step's forward with this step's outputs (rung 12)")

    def __post_init__(self):
        check_bool("async_scheduling", self.async_scheduling)

    def components(self, configs: dict) -> dict:
        """The engine's executor, when it overlaps."""
        if not self.async_scheduling:
            return {}
        from .engine import ThreadExecutor
        return {"executor": ThreadExecutor()}
