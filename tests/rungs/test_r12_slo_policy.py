"""Rung 12's deadline policy ``slo`` (core/policy.py, notebook 12): its options and request fields
are checked (a ValueError / RequestError / HTTP 400 naming the field); on random streams it admits
in earliest-deadline order, nobody arriving past the starvation horizon overtakes a request, every
request ends once and the pool is full after; on a crafted mix it meets more deadlines than
``fcfs``, ``priority`` and ``score``. All on the scheduler's clock billed by a cost model
(``r12_realtime.sim``): no wall-clock time."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, Request, SamplingParams
from minillm.engines import build_components
from minillm.engines.r12_realtime.config import RealtimeConfig
from minillm.engines.r12_realtime.slo import SLO, parse_slo_classes
from minillm.engines.r12_realtime.sim import sim_engine, sim_request, simulate
from minillm.request import RequestError


def test_options_and_fields_are_checked():
    policy = build_components(dict(policy="slo", slo_ttft_ms=250, slo_tpot_ms=40,
                                         slo_margin_ms=0))["policy"]
    assert policy == SLO(250.0, 40.0, 0.0)
    for name, bad in (("slo_ttft_ms", 0), ("slo_tpot_ms", math.nan), ("slo_margin_ms", -1),
                      ("slo_ttft_ms", "fast"), ("slo_tpot_ms", 1e30)):
        with pytest.raises(ValueError, match=name):
            RealtimeConfig(**{name: bad})
    engine = sim_engine("slo")
    for name, bad in (("ttft_slo_ms", -5.0), ("tpot_slo_ms", math.inf), ("ttft_slo_ms", "x")):
        req = Request([1, 2], SamplingParams(max_tokens=2), **{name: bad})
        with pytest.raises(RequestError, match=name):
            engine.add_request(req)
    assert not engine.has_unfinished()


def test_class_objectives_are_checked_and_a_requests_own_win_field_by_field():
    """``slo_classes``: a request of priority P that names no objective gets its class's; one it
    names wins for that field only; other priorities get the defaults."""
    policy = build_components(dict(policy="slo", slo_ttft_ms=700, slo_tpot_ms=70,
                                         slo_classes=" 1:300:50, 0:20000:500"))["policy"]
    assert policy.classes == ((1, 300.0, 50.0), (0, 20000.0, 500.0))
    cases = [(1, None, None, (300.0, 50.0)), (0, None, None, (20000.0, 500.0)),
             (1, 900.0, None, (900.0, 50.0)), (0, None, 8.0, (20000.0, 8.0)),
             (7, None, None, (700.0, 70.0)), (7, 1.0, 2.0, (1.0, 2.0))]
    for priority, ttft, tpot, want in cases:
        req = sim_request("r", 4, 2, ttft_ms=ttft, tpot_ms=tpot, priority=priority)
        assert policy.objectives(req) == want, (priority, ttft, tpot)
    assert parse_slo_classes(None) == parse_slo_classes(" ") == ()
    assert parse_slo_classes("1:300:50;0:20000:500") == policy.classes   # as a --serve name has it
    for bad, says in (("1:300", "'1:300' is not PRIORITY:TTFT_MS:TPOT_MS"),
                      ("1:0:50", "TTFT must be in"), ("a:1:1", "'a:1:1'"),
                      ("1:5:inf", "TPOT must be a finite number"),
                      ("2:1:1,2:3:3", "priority 2 is given twice"), (12, "must be a string")):
        with pytest.raises(ValueError, match=f"slo_classes.*{says}|{says}.*"):
            RealtimeConfig(slo_classes=bad)


def test_classes_alone_let_slo_meet_the_deadlines_requests_do_not_name():
    """The crafted mix below with no objective on any request: only the priorities (batch 0,
    chat 1) and the server's classes say who is urgent. ``slo`` with the classes meets all
    twelve, as with the objectives on the requests. Without them every request is held to the
    defaults (1 s / 100 ms): the chats' deadlines are then no tighter than the batch's, and some
    chat misses its 300 ms; fcfs misses all six."""
    classes = "0:20000:200,1:300:200"
    judge = SLO(classes=parse_slo_classes(classes))
    met = {}
    for name, options in (("fcfs", {}), ("slo", {}), ("slo+classes", {"slo_classes": classes})):
        engine = sim_engine(name.split("+")[0], max_num_seqs=3, **options)
        run = simulate(engine, crafted(named=False), judge=judge)
        assert set(run.ends.values()) == {1} and len(run.ends) == 12
        met[name] = run.goodput
    assert met["slo+classes"] == 12 and met["slo"] < 12 and met["fcfs"] == 6, met


def crafted(named: bool = True):
    """Long jobs with loose objectives first, short chats with tight TTFT arriving behind them."""
    arrivals = [(0, sim_request(f"batch{i}", 64, 32, ttft_ms=20000 if named else None,
                                tpot_ms=200 if named else None, priority=0)) for i in range(6)]
    arrivals += [(2 + 3 * i, sim_request(f"chat{i}", 8, 8, ttft_ms=300 if named else None,
                                         tpot_ms=200 if named else None,
                                         priority=0 if named else 1))
                 for i in range(6)]
    return arrivals


def test_slo_meets_more_deadlines_than_fcfs_priority_and_score():
    met = {}
    for policy in ("fcfs", "priority", "score", "slo"):
        engine = sim_engine(policy, max_num_seqs=3)
        run = simulate(engine, crafted())
        assert set(run.ends.values()) == {1} and len(run.ends) == 12
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        met[policy] = run.goodput
    # every chat meets its TTFT under slo (and every batch job its loose one); fcfs queues the
    # chats behind the batch and misses all six
    assert met["slo"] == 12 and met["fcfs"] == 6, met
    assert met["slo"] > max(met["priority"], met["score"]), met


def test_slo_over_http_reaches_the_request_and_bad_values_are_a_400(tiny):
    import httpx
    from serve_util import running_server

    llm = LLM(tiny, engine="paged", num_blocks=64, max_num_seqs=4, policy="slo")
    seen = []
    with running_server(llm, max_waiting=16) as (url, app):
        app.state.loop.on_step.append(lambda loop, out: seen.extend(
            (r.ttft_slo_ms, r.tpot_slo_ms) for r in out.finished))
        body = {"model": "tiny-llama", "max_tokens": 2, "temperature": 0, "prompt": "hi"}
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={**body, "ttft_slo_ms": 250, "tpot_slo_ms": 12.5})
        assert r.status_code == 200, r.text
        for name, bad in (("ttft_slo_ms", 0), ("tpot_slo_ms", -1), ("ttft_slo_ms", "soon"),
                          ("tpot_slo_ms", True), ("ttft_slo_ms", 1e15)):
            r = httpx.post(f"{url}/v1/completions", json={**body, name: bad}, timeout=60)
            assert r.status_code == 400 and name in r.text, (name, bad, r.text)
    assert seen == [(250.0, 12.5)]


# --- the property: EDF order, the starvation horizon, one end each, the pool full after ------------
request = st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(1, 12),
                    st.one_of(st.none(), st.sampled_from([20.0, 80.0, 300.0, 2000.0])),
                    st.one_of(st.none(), st.sampled_from([5.0, 30.0, 200.0])))


@settings(max_examples=40, deadline=None)
@given(st.lists(request, min_size=1, max_size=24), st.integers(1, 4), st.integers(6, 40),
       st.sampled_from([0.0, 50.0]))
def test_slo_admits_by_deadline_and_nobody_starves(reqs, max_seqs, num_blocks, margin):
    arrivals = [(at, sim_request(f"r{i}", p, m, ttft, tpot))
                for i, (at, p, m, ttft, tpot) in enumerate(reqs)]
    engine = sim_engine("slo", num_blocks=num_blocks, block_size=4, max_num_seqs=max_seqs,
                        slo_margin_ms=margin, slo_ttft_ms=500.0, slo_tpot_ms=50.0)
    for _, r in arrivals:          # one that could never fit alone is not part of the property
        if 4 * num_blocks < r.prompt_len + r.params.max_tokens:
            r.params = SamplingParams(max_tokens=1, ignore_eos=True)
            r.prompt_token_ids = [1]
    policy, sched = engine.scheduler.policy, engine.scheduler
    keys: dict[str, tuple] = {}             # a waiting request's key (fixed while it waits)
    first_admit: dict[str, int] = {}
    waiting_before: set[str] = set()

    def on_step(out, record):
        nonlocal waiting_before
        running = {g.request.request_id for g in sched.running}
        admitted = [rid for rid in waiting_before if rid in running]
        still = [rid for rid in waiting_before if rid not in running and rid in sched.groups]
        if admitted and still:              # earliest deadline first: nobody overtakes the head
            assert max(keys[a] for a in admitted) <= min(keys[s] for s in still)
        for rid in [*running, *(r.request_id for r in out.finished)]:
            first_admit.setdefault(rid, record.step)
        for g in sched.waiting:
            keys[g.request.request_id] = policy.key(g)
        waiting_before = {g.request.request_id for g in sched.waiting}

    run = simulate(engine, arrivals, SLO(500.0, 50.0), on_step=on_step, max_steps=20_000)
    assert set(run.ends.values()) == {1} and len(run.ends) == len(arrivals)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # the starvation horizon: nobody arriving more than D ms after r is first admitted before r
    min_ttft = min(r.ttft_slo_ms or 500.0 for _, r in arrivals)
    assert set(first_admit) == set(run.timings)
    for rid, t in run.timings.items():
        horizon = policy.overtake_horizon_ms(sched_group_at_arrival(engine, t), min_ttft)
        for other, u in run.timings.items():
            if u.arrival_ms > t.arrival_ms + horizon:
                assert first_admit[other] >= first_admit[rid], (rid, other, horizon)


def sched_group_at_arrival(engine, timing):
    """A stand-in group with the request's arrival and objectives, no token generated yet (the
    deadline ``overtake_horizon_ms`` starts from)."""
    from minillm.core.sequence import Sequence, SequenceGroup
    req = Request([1], SamplingParams(max_tokens=1), ttft_slo_ms=timing.ttft_slo_ms,
                  tpot_slo_ms=timing.tpot_slo_ms)
    return SequenceGroup(req, [Sequence(req, [1], 1)], 0, 0, timing.arrival_ms)


def test_the_deadlines_mix_tells_classes_apart_by_objectives_only():
    """``bench --serve ... --mix deadlines``: one priority, so only ``slo`` can see which
    requests are urgent; each body carries its class's objectives."""
    from minillm.bench.mixed import make_mixed_bodies
    bodies, classes = make_mixed_bodies("m", 40, 0, "deadlines")
    assert {b["priority"] for b in bodies} == {0}
    assert {c.name for c in classes} == {"urgent", "background"}
    for body, c in zip(bodies, classes):
        assert body["ttft_slo_ms"] == c.slo_ttft_ms and len(body["prompt"]) == c.input_len
    urgent = next(c for c in classes if c.name == "urgent")
    background = next(c for c in classes if c.name == "background")
    assert urgent.slo_ttft_ms < background.slo_ttft_ms and urgent.max_tokens > background.max_tokens
