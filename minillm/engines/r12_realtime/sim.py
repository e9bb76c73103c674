"""Rung 12 on a clock of steps (notebook 12, ``tests/rungs/test_r12_slo_policy.py``,
``tests/rungs/test_r12_batch_controller.py``): the real ``PagedEngine`` — its scheduler, policy and batch
controller — computing nothing (rung 5's ``NullRunner``), every step timed by a cost
model ``a + b * tokens`` ms (``step_cost``). Deadlines, TTFT and TPOT are then read on the
scheduler's own clock (``Scheduler.now_ms``), so a run is the same on every machine and the
policies can be compared request by request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.block_manager import BlockManager
from ...runtime.driver import Driver, ScheduledArrivals, StepClock
from ...core.engine import PagedEngine
from .. import engine_kwargs
from .slo import SLO
from ...core.sequence import Sequence
from ...request import Request, SamplingParams
from ..r5_allocators.null import NullRunner, ReplayModel

SIM_TOKEN = 7       # what every sample "generates": never an end, so a request runs max_tokens


class ConstSampler:
    """Every row's token is ``SIM_TOKEN``: lengths are the requests' ``max_tokens``."""

    def __call__(self, logits, rows: list[tuple[int, Sequence]]):
        return [(seq, SIM_TOKEN) for _, seq in rows], []


def sim_engine(policy: str = "fcfs", cost: tuple[float, float] = (5.0, 0.5),
               num_blocks: int = 256, block_size: int = 8, **options) -> PagedEngine:
    """A ``PagedEngine`` that computes nothing and times each step ``a + b * tokens`` ms;
    ``options``: its scheduler's (``max_num_seqs``, ``batch_controller``, the policy's)."""
    a, b = cost
    return PagedEngine(ReplayModel(1 << 16, 1), block_size=block_size, runner=NullRunner(),
                       sampler=ConstSampler(), block_manager=BlockManager(num_blocks, block_size),
                       step_cost=lambda sched: a + b * sched.num_tokens,
                       **engine_kwargs({"policy": policy, **options}))


def sim_request(rid: str, prompt_len: int, max_tokens: int, ttft_ms: float | None = None,
                tpot_ms: float | None = None, priority: int = 0) -> Request:
    return Request([1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   request_id=rid, priority=priority, ttft_slo_ms=ttft_ms, tpot_slo_ms=tpot_ms)


@dataclass
class Timing:
    """One request on the scheduler's clock (ms)."""

    arrival_ms: float
    ttft_slo_ms: float
    tpot_slo_ms: float
    first_ms: float | None = None
    finish_ms: float | None = None
    num_tokens: int = 0

    @property
    def ttft_ms(self) -> float:
        return self.first_ms - self.arrival_ms

    @property
    def tpot_ms(self) -> float:
        return (self.finish_ms - self.first_ms) / max(1, self.num_tokens - 1)

    @property
    def met(self) -> bool:
        """Both objectives held (what goodput counts)."""
        return self.ttft_ms <= self.ttft_slo_ms and self.tpot_ms <= self.tpot_slo_ms


@dataclass
class SimRun:
    timings: dict[str, Timing] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)   # per step: clock, cost, tokens, cap, queue
    ends: dict[str, int] = field(default_factory=dict)    # request id -> times it ended

    @property
    def goodput(self) -> int:
        return sum(t.met for t in self.timings.values())


def simulate(engine: PagedEngine, arrivals: list[tuple[int, Request]],
             judge: SLO = SLO(), max_steps: int = 5000,
             on_step=None) -> SimRun:
    """Serve ``(step, request)`` arrivals; time each request on the scheduler's clock.
    ``judge``: whose objectives a request is held to where it names none (``SLO.objectives``:
    its priority class's, else the defaults, 1000 / 100 ms), whatever the engine's policy."""
    sched, run = engine.scheduler, SimRun()
    reqs = {r.request_id: r for _, r in arrivals}

    def admitted(req: Request) -> None:
        ttft, tpot = judge.objectives(req)
        run.timings[req.request_id] = Timing(sched.now_ms, ttft, tpot)

    def stepped(out, record) -> None:
        for rid, t in run.timings.items():
            n = len(reqs[rid].output_token_ids)
            if n and t.first_ms is None:
                t.first_ms = sched.now_ms
            t.num_tokens = n
        for req in out.finished:
            run.ends[req.request_id] = run.ends.get(req.request_id, 0) + 1
            run.timings[req.request_id].finish_ms = sched.now_ms
        run.steps.append({"step": record.step, "now_ms": sched.now_ms,
                          "tokens": out.num_prefill_tokens + out.num_decode_tokens,
                          "cap": sched.step_budget(), "running": len(sched.running),
                          "waiting": [g.request.request_id for g in sched.waiting]})
        if on_step is not None:
            on_step(out, record)

    driver = Driver(engine, StepClock("tick"), ScheduledArrivals(arrivals), on_admit=admitted,
                    on_step=stepped, max_steps=max_steps)
    driver.run()
    return run
