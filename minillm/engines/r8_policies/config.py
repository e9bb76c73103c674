"""Rung 8's options (notebook 08): ``policy`` and the weights of ``priority`` and ``score``. The
config plugs the policy it names into the paged engine (``components``); ``slo``'s objectives
are rung 12's options (``engines/r12_realtime/config.py``), which build that one."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...checks import check_float
from ...runtime.config import option, set_checked
from .policy import MAX_SCORE_WEIGHT, Priority, Score

POLICIES = ("fcfs", "priority", "score", "slo")


@dataclass(frozen=True)
class PolicyConfig:
    """Who goes first, and who may evict whom."""

    policy: str = option("fcfs", f"paged: scheduling order ({', '.join(POLICIES)}; "
                                 "engines/r8_policies, r12_realtime/slo.py)")
    priority_preemption_threshold: int = option(
        0, "paged, policy=priority: a waiting request evicts a running one whose priority value "
           "is higher by more than this")
    score_wait_weight: float = option(1.0, "paged, policy=score: weight of each step waited")
    score_remaining_weight: float = option(
        0.1, "paged, policy=score: weight of each token still to generate")
    score_priority_weight: float = option(
        20.0, "paged, policy=score: weight of each unit of request priority (in steps of "
              "waiting; the starvation bound grows with it, engines/r8_policies/policy.py)")
    score_margin: float = option(
        10.0, "paged, policy=score: a waiting request evicts a running one only if its score is "
              "lower by more than this")

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        set_checked(self, "priority_preemption_threshold", minimum=0)
        for name in ("score_wait_weight", "score_remaining_weight", "score_priority_weight",
                     "score_margin"):
            value = check_float(name, getattr(self, name))
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
            # bounded so that a score stays finite for any accepted request (policy.py)
            if name != "score_margin" and value > MAX_SCORE_WEIGHT:
                raise ValueError(f"{name} must be <= {MAX_SCORE_WEIGHT:g}, got {value!r}")
            object.__setattr__(self, name, value)

    def components(self, configs: dict) -> dict:
        """The policy, for the engine's ``policy=``: ``slo`` is built by rung 12's config, which
        an engine that keeps several steps in flight does not take (no one step time reaches
        its scheduler's clock)."""
        if self.policy == "priority":
            return {"policy": Priority(self.priority_preemption_threshold)}
        if self.policy == "score":
            return {"policy": Score(self.score_wait_weight, self.score_remaining_weight,
                                    self.score_priority_weight, self.score_margin)}
        if self.policy == "slo" and "realtime_config" not in configs:
            raise ValueError(f"policy='slo': engine {configs['engine']!r} keeps several steps in "
                             "flight, so no one step time reaches the scheduler's clock, and "
                             "'slo' runs on that clock: use engine 'paged'")
        return {}


def policy_options(*configs) -> dict:
    """The policy's weights that differ from their defaults (what a trace keeps), from the
    engine's ``PolicyConfig`` and rung 12's ``RealtimeConfig``."""
    out = {}
    for config in configs:
        for f in dataclasses.fields(config):
            if f.name != "policy" and f.name.startswith(("priority_", "score_", "slo_")) and \
                    getattr(config, f.name) != f.default:
                out[f.name] = getattr(config, f.name)
    return out
