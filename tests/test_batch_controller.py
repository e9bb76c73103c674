"""Rung 12's adaptive batch (core/batch_controller.py, notebook 12): against a fake cost model
(step time = a + b * tokens, the step's measurement injected) the cap converges to the widest
batch within the TPOT target and stays there (no oscillation), widens when steps get cheaper,
never falls below 1 (nor below a request's n samples), and in the engine holds every step under
the target where a fixed batch does not, with its decisions as observer events and in
``describe()``. No wall-clock time anywhere."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import Request, SamplingParams
from minillm.core.batch_controller import TPOTController, make_controller
from minillm.core.config import SchedulerConfig
from minillm.engines.r12_realtime.sim import sim_engine, sim_request, simulate


def drive(ctl: TPOTController, a: float, b: float, demand: int, steps: int) -> list[int]:
    """Steps of min(cap, demand) tokens billed a + b * tokens; the cap after each."""
    caps = []
    for _ in range(steps):
        n = min(ctl.cap, demand)
        ctl.observe(n, a + b * n)
        caps.append(ctl.cap)
    return caps


@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 40.0), st.floats(0.01, 5.0), st.floats(5.0, 200.0),
       st.integers(1, 2048))
def test_cap_converges_under_the_target_and_stays(a, b, target, ceiling):
    ctl = TPOTController(target, ceiling)
    caps = drive(ctl, a, b, demand=10_000, steps=80)
    best = max(1, min(ceiling, math.floor((0.95 * target - a) / b + 1e-9)))
    assert all(c >= 1 for c in caps)
    assert caps[-20:] == [caps[-1]] * 20                 # settled: no oscillation
    assert caps[-1] >= 1 and abs(caps[-1] - best) <= max(1, best // 50)
    if best > 1:                                         # a step at the cap is within target
        assert a + b * caps[-1] <= target


def test_cap_widens_when_steps_get_cheaper_and_narrows_when_dearer():
    ctl = TPOTController(50.0, 1024)
    slow = drive(ctl, 5.0, 1.0, demand=1000, steps=20)[-1]
    fast = drive(ctl, 5.0, 0.25, demand=1000, steps=30)[-1]
    dear = drive(ctl, 5.0, 2.0, demand=1000, steps=10)[-1]
    # the widest within 0.95 * 50 ms: 42, 170, 21 (widening stops within its 2% hysteresis)
    assert slow == 42 and 170 - 170 // 50 <= fast <= 170 and dear == 21


def test_config_and_make_controller():
    assert make_controller(SchedulerConfig()).cap is None
    ctl = make_controller(SchedulerConfig(batch_controller="tpot", tpot_target_ms=30,
                                          max_num_batched_tokens=256))
    assert (ctl.target_ms, ctl.cap) == (30.0, 256)
    with pytest.raises(ValueError, match="batch_controller"):
        SchedulerConfig(batch_controller="pid")
    with pytest.raises(ValueError, match="tpot_target_ms"):
        SchedulerConfig(tpot_target_ms=0)


def burst(n=40):
    return [(i // 8, sim_request(f"r{i}", 16, 24)) for i in range(n)]


def test_engine_holds_the_target_where_a_fixed_batch_does_not():
    target, cost = 40.0, (5.0, 1.0)
    fixed = simulate(sim_engine("fcfs", cost, max_num_seqs=64), burst())
    events = []
    engine = sim_engine("fcfs", cost, max_num_seqs=64, batch_controller="tpot",
                        tpot_target_ms=target)
    engine.observers.add(lambda e: events.append(e.data), ("controlled",))
    ctl = simulate(engine, burst())
    cost_of = [cost[0] + cost[1] * s["tokens"] for s in ctl.steps if s["tokens"]]
    assert max(cost[0] + cost[1] * s["tokens"] for s in fixed.steps) > 3 * target
    assert max(cost_of[2:]) <= target        # after the first steps measured, every step holds
    assert events and events[0].old_cap == 1024 and events[-1].new_cap == 33
    assert engine.scheduler.controller.describe()["batch_cap"] == 33   # (describe() adds it)
    for run in (fixed, ctl):
        assert set(run.ends.values()) == {1} and len(run.ends) == 40
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_impossible_target_narrows_to_one_and_nobody_starves():
    engine = sim_engine("fcfs", (50.0, 1.0), max_num_seqs=8, batch_controller="tpot",
                        tpot_target_ms=10.0)
    arrivals = burst(12)
    arrivals.append((0, Request([1] * 5, SamplingParams(max_tokens=6, n=3, ignore_eos=True,
                                                         temperature=1.0, seed=0),
                                request_id="n3")))
    run = simulate(engine, arrivals)
    assert engine.scheduler.controller.cap == 1
    assert min(s["cap"] for s in run.steps) >= 1
    assert set(run.ends.values()) == {1} and len(run.ends) == 13
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("extra", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)])
@pytest.mark.parametrize("rung12", [dict(policy="slo"),
                                    dict(batch_controller="tpot", tpot_target_ms=50.0)])
def test_engines_that_bill_no_step_time_refuse_slo_and_tpot_by_name(tiny, extra, rung12):
    """The pipeline's micro-batches overlap: it has no step time for the scheduler's clock, so
    'slo' and 'tpot' (which run on it) are refused before any worker starts."""
    if tiny.device.type == "cuda":
        pytest.skip("on GPUs, spawned workers are refused first (one process per GPU: torchrun)")
    from minillm.engines import create_engine
    with pytest.raises(ValueError, match="bills no step time"):
        create_engine("paged", tiny, num_blocks=16, **extra, **rung12)
