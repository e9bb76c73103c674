"""``EngineStats``: an engine's counts at one moment, as one frozen record (vLLM's
``SchedulerStats``).

Stats flow one way. The thread that drives an engine builds a record (``EngineStats.of(engine)``) right
after a step, the only moment the engine's state is consistent; everyone else reads records and
never the engine. The server's engine loop (``serve/loop.py``) builds one after every step, after
a failure or reset and when it starts, and keeps the newest as one attribute (``loop.stats``):
``/metrics`` (``serve/metrics.py``) and the dashboard (``serve/dashboard.py``) read that.

A record is a value: numbers, copies and freshly drawn pictures, never a live object the engine
goes on changing, so a reader on any thread sees one consistent moment. The counts are cheap
(every step); ``detail`` adds what a dashboard frame draws (the pool's picture, the requests in
flight with their tokens so far), built only when a frame is.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from ..memory import KVCounts, MemorySnapshot
from ..request import Request

if TYPE_CHECKING:
    from .interface import Engine


@dataclass(frozen=True)
class RequestStats:
    """One request as a view lists it, its tokens copied when the record was made."""

    request_id: str
    prompt_len: int
    output_token_ids: tuple[int, ...]   # so far (n > 1: the first sample's)
    max_tokens: int | None
    n: int
    num_preemptions: int
    priority: int

    @classmethod
    def of(cls, req: Request, live: list[int] | None = None) -> "RequestStats":
        """``live``: the engine's ``live_tokens`` for it, if any (else its ``output_token_ids``)."""
        out = live if live is not None else req.output_token_ids
        return cls(req.request_id, req.prompt_len, tuple(out), req.params.max_tokens,
                   req.params.n, req.num_preemptions, req.priority)


@dataclass(frozen=True)
class EngineDetail:
    """What a dashboard frame draws beyond the counts (``EngineStats.of(engine, detail=True)``)."""

    engine_name: str
    model_name: str
    about: Mapping                                  # ``describe()``: policy, KV format, ...
    snapshot: MemorySnapshot                        # the KV pool's picture
    running: tuple[RequestStats, ...] | None        # None: the engine keeps no such lists
    waiting: tuple[RequestStats, ...] | None
    stages: Mapping[str, tuple[RequestStats, ...]]  # on their way in (rung 11)
    has_prefill_pool: bool                          # rung 11: a second pool ...
    prefill_snapshot: MemorySnapshot | None         # ... and its picture (None: not known yet)


@dataclass(frozen=True)
class EngineStats:
    """An engine's counts after a step (see the module)."""

    step: int                    # steps the engine ever ran (``total_steps``)
    num_running: int             # requests holding KV memory
    num_waiting: int             # added, not yet holding KV memory
    has_unfinished: bool
    kv: KVCounts                 # KV slots by kind
    num_preemptions: int         # cumulative since the engine was made
    prefix_hit_tokens: int       # cumulative: prompt tokens served from the prefix cache
    batch_control: Mapping | None = None   # rung 12's controller (``batch_control()``), or None
    detail: EngineDetail | None = None

    @property
    def batch_cap(self) -> int | None:
        """Rung 12: the step's token budget now (None: a fixed batch)."""
        return None if self.batch_control is None else self.batch_control.get("batch_cap")

    @property
    def batch_load(self) -> float | None:
        """Rung 12: the arrivals' work over what the TPOT target's batch serves."""
        return None if self.batch_control is None else self.batch_control.get("load")

    @classmethod
    def of(cls, engine: Engine, detail: bool = False, kv: KVCounts | None = None) -> "EngineStats":
        """``engine``'s record now, from the methods ``Engine`` declares (``Engine.stats``); call
        it on the thread that drives the engine. ``kv``: its ``kv_counts()`` already taken now."""
        control = engine.batch_control()
        return cls(step=engine.total_steps, num_running=engine.num_running(),
                   num_waiting=engine.num_waiting(), has_unfinished=engine.has_unfinished(),
                   kv=kv if kv is not None else engine.kv_counts(),
                   num_preemptions=int(engine.num_preemptions),
                   prefix_hit_tokens=int(engine.prefix_hit_tokens),
                   batch_control=None if control is None else MappingProxyType(dict(control)),
                   detail=_detail(engine) if detail else None)


def _detail(engine: Engine) -> EngineDetail:
    def rows(reqs) -> tuple[RequestStats, ...]:
        return tuple(RequestStats.of(r, engine.live_tokens(r.request_id)) for r in reqs)

    lists = engine.requests_in_flight()
    return EngineDetail(
        engine_name=engine.name, model_name=engine.model.name,
        about=MappingProxyType(dict(engine.describe())), snapshot=engine.snapshot(),
        running=None if lists is None else rows(lists[0]),
        waiting=None if lists is None else rows(lists[1]),
        stages=MappingProxyType({stage: rows(reqs) for stage, reqs in engine.stages().items()}),
        has_prefill_pool=engine.has_prefill_pool,
        prefill_snapshot=engine.prefill_snapshot() if engine.has_prefill_pool else None)
