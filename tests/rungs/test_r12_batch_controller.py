"""Rung 12's adaptive batch (engines/r12_realtime/batch_controller.py, notebook 12): against a fake cost model
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
from minillm.engines.r12_realtime.batch_controller import Demand, TPOTController
from minillm.engines import build_components
from minillm.engines.r12_realtime.config import RealtimeConfig
from minillm.core.engine import PagedEngine
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


def make_controller(**options):
    """The controller the registry gives the paged engine for these options (None: none)."""
    return build_components(options).get("controller")


def test_config_and_make_controller():
    assert make_controller() is None
    ctl = make_controller(batch_controller="tpot", tpot_target_ms=30, max_num_batched_tokens=256)
    assert (ctl.target_ms, ctl.cap) == (30.0, 256)
    with pytest.raises(ValueError, match="batch_controller"):
        RealtimeConfig(batch_controller="pid")
    with pytest.raises(ValueError, match="tpot_target_ms"):
        RealtimeConfig(tpot_target_ms=0)
    with pytest.raises(ValueError, match="tpot_overload 'shed'"):
        RealtimeConfig(tpot_overload="shed")
    assert make_controller(batch_controller="tpot", tpot_overload="widen").overload == "widen"


def test_demand_is_the_arrival_rate_times_the_work_of_a_request():
    demand = Demand(tau_ms=2000.0)
    assert demand.per_ms(0.0) is None                 # nothing arrived: unknown
    for k in range(200):                              # one arrival every 100 ms for 20 s
        demand.arrived(100.0 * k, at_most=500)
    assert demand.rate_at(19_900.0) == pytest.approx(0.01, rel=0.03)
    assert demand.per_ms(19_900.0) == pytest.approx(0.01 * 500, rel=0.03)  # nothing finished
    demand.finished(100)
    demand.finished(200)                              # a moving average: 100 + 0.2 * 100
    assert demand.per_ms(19_900.0) == pytest.approx(0.01 * 120, rel=0.03)
    assert demand.rate_at(29_900.0) < 0.01 * 0.01     # 10 s without arrivals: forgotten


def overload(policy: str, steps: int = 120) -> tuple[list[dict], PagedEngine]:
    """Two requests of 8 + 32 tokens arrive every step: 80 tokens of work a step, whatever a step
    costs, where 20 + 0.5 n ms within 0.95 x 40 ms allows a budget of 36."""
    engine = sim_engine("fcfs", (20.0, 0.5), num_blocks=4096, max_num_seqs=256,
                        batch_controller="tpot", tpot_target_ms=40.0, tpot_overload=policy)
    arrivals = [(k // 2, sim_request(f"r{k}", 8, 32)) for k in range(2 * steps)]
    seen = []
    run = simulate(engine, arrivals, on_step=lambda out, rec: seen.append(
        engine.scheduler.controller.describe()))
    assert set(run.ends.values()) == {1} and len(run.ends) == 2 * steps
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [{**step, **about} for step, about in zip(run.steps, seen)], engine


def test_arrivals_that_outrun_the_target_are_held_or_widened_for():
    held, _ = overload("hold")
    widened, _ = overload("widen")
    during = slice(80, 120)             # arrivals still coming, the rate's estimate settled
    # the load is the arrivals' 80 tokens a step over the target's batch: above 1 in both
    assert all(s["load"] > 1.2 for s in held[during] + widened[during])
    # hold: every step within the target, the queue grows by about a request a step
    assert max(s["cap"] for s in held[during]) <= 36
    assert all(20 + 0.5 * s["tokens"] <= 40 for s in held[2:])
    assert len(held[119]["waiting"]) > len(held[80]["waiting"]) + 30
    # widen: about the narrowest batch that keeps up (88 tokens: 1.1 x 80, within the 2% the
    # controller lets pass before it widens), the queue short and not growing
    assert all(86 <= s["cap"] <= 96 for s in widened[during])
    assert max(len(s["waiting"]) for s in widened[during]) < 20
    assert len(widened[119]["waiting"]) <= len(widened[80]["waiting"])


def test_no_load_is_claimed_before_the_fit_has_seen_a_spread():
    """Steps of one size from the start leave the fit at b = t / n (every ms on the tokens): a
    load computed from it would call two requests an overload. None until the sizes differ."""
    from minillm.engines.r12_realtime.batch_controller import LoadAwareController
    ctl = LoadAwareController(40.0, 1024, overload="widen")
    for k in range(20):
        ctl.arrived(30.0 * k, at_most=5)         # 5 tokens every 30 ms: a light load
        ctl.observe(4, 30.0)                     # 4 tokens a step, 30 ms: mostly fixed cost
        assert ctl.load is None and ctl.cap <= 5
    ctl.observe(12, 34.0)                        # a wider step: a and b can be told apart
    assert ctl.load is not None and ctl.load < 1.0


def test_arrivals_a_light_load_brings_change_nothing():
    """One short request every fourth step: the load stays below 1 and widen's batch is hold's."""
    caps = {}
    for policy in ("hold", "widen"):
        engine = sim_engine("fcfs", (20.0, 0.5), batch_controller="tpot", tpot_target_ms=40.0,
                            tpot_overload=policy)
        run = simulate(engine, [(4 * k, sim_request(f"r{k}", 8, 8)) for k in range(40)])
        caps[policy] = [s["cap"] for s in run.steps]
        assert engine.scheduler.controller.load < 1.0
    assert caps["hold"] == caps["widen"]


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
def test_engines_that_keep_steps_in_flight_refuse_slo_and_tpot_by_name(tiny, extra, rung12):
    """The pipeline's micro-batches overlap: it has no step time for the scheduler's clock, so
    'slo' and 'tpot' (which run on it) are refused before any worker starts: the policy by its
    own words, the controller's options as options the engine does not take."""
    if tiny.device.type == "cuda":
        pytest.skip("on GPUs, spawned workers are refused first (one process per GPU: torchrun)")
    from minillm.engines import create_engine
    with pytest.raises(ValueError, match="keeps several steps in flight|bad option for engine "
                                         "'(pipeline|tensor)': batch_controller, tpot_target_ms"):
        create_engine("paged", tiny, num_blocks=16, **extra, **rung12)


def test_the_dashboard_shows_the_cap_and_the_load(tiny):
    """A server with ``--batch-controller tpot``: its dashboard frames carry the controller's
    state as the engine describes it (the page draws it beside the step counter)."""
    import json

    import httpx
    from serve_util import running_server, wait_until

    from minillm.bench.compare import MetricsWatch, metric_values

    from minillm import LLM
    body = {"model": "tiny-llama", "prompt": "count from one to twenty, slowly", "max_tokens": 4}
    llm = LLM(tiny, engine="paged", num_blocks=64, batch_controller="tpot", tpot_target_ms=500.0,
              tpot_overload="widen")
    frames = []
    with running_server(llm) as (url, app):
        with MetricsWatch(url, period_s=0.02) as watch:
            with httpx.stream("GET", f"{url}/dashboard/events", timeout=60) as r:
                for line in r.iter_lines():     # bounded: the test stops at the third frame
                    if line.startswith("data: "):
                        frames.append(json.loads(line[6:]))
                        httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                        if len(frames) == 3:
                            break
            wait_until(lambda: len(watch.samples) >= 2, 30, "two polls of /metrics")
        scraped = metric_values(httpx.get(f"{url}/metrics", timeout=30).text)
    shown = frames[-1]["controller"]
    assert set(shown) == {"batch_cap", "tpot_target_ms", "tpot_overload", "arrivals_per_s", "load"}
    assert shown["tpot_target_ms"] == 500.0 and shown["tpot_overload"] == "widen"
    assert 1 <= shown["batch_cap"] <= llm.engine.scheduler.max_num_batched_tokens
    assert shown["arrivals_per_s"] > 0 and shown["load"] is not None   # requests came, ended
    # /metrics has the cap and the load too, and the bench's poller reads them
    control = llm.engine.batch_control()
    assert scraped["minillm:batch_cap"] == control["batch_cap"]
    assert scraped["minillm:batch_load"] == control["load"]
    assert all(len(x) == 4 and x[3] >= 1 and x[1] >= 0 and x[2] >= 0 for x in watch.samples)
    with running_server(LLM(tiny, engine="paged", num_blocks=64)) as (url, app):
        assert "controller" not in app.state.dashboard.frame
        scraped = metric_values(httpx.get(f"{url}/metrics", timeout=30).text)
        assert "minillm:batch_cap" not in scraped and "vllm:num_requests_running" in scraped
