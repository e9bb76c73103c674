"""Exercise 12 — the adaptive batch: ``TPOTController.observe``, ``TPOTController._fit`` and
``TPOTController._cap`` (``minillm/engines/r12_realtime/batch_controller.py``).

Graded on behaviour, never on the clock: the controller is driven with synthetic step times, each
step of ``min(cap, demand)`` tokens billed ``a + b * tokens`` ms (sometimes with a seeded
measurement noise of 1%), then inside the real engine with steps billed by a cost model
(``step_cost``). It must: fall back to ``b = t / n`` when the steps have never had a spread (one
step, or a steady batch from the start) and keep the fit's fixed part when a steady batch loses
its spread later (forgotten, the arrival rate's "widen" swings); ignore a step of no tokens or
whose time is negative or not finite; never leave [1, ceiling]; settle
on the widest batch within the target and stay there (an AIMD halve/+1 rule never settles); not
move the batch back and forth on noise (no hysteresis does); follow the cost when it moves, both
ways (a fit that never forgets lags); return a ``BatchDecision`` exactly when the cap moved; and
hold the target in the engine.

The drives run in the student's process (``probe_*``, the ``student`` fixture) and send back the
caps, the decisions and what was raised, judged here.
"""
from __future__ import annotations

import math
import random

import pytest

from minillm.engines.r12_realtime.batch_controller import TPOTController

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
HEADROOM = 0.95      # the fraction of the target the controller aims at (its default)


def best_cap(a: float, b: float, target: float, ceiling: int) -> int:
    """The widest batch predicted within ``HEADROOM * target`` (the module's definition)."""
    return max(1, min(ceiling, math.floor((HEADROOM * target - a) / b + 1e-9)))


def probe_drive(target: float, ceiling: int, phases: list) -> dict:
    """A ``TPOTController(target, ceiling)`` told of steps: for each phase ``(a, b, demand,
    steps, noise, seed)``, ``steps`` steps of ``min(cap, demand)`` tokens (at least 1, as the
    scheduler's budget is) billed ``(a + b * n) * (1 + noise * u)``, u uniform in [-1, 1)."""
    ctl = TPOTController(target, ceiling)
    caps, decisions, steps, raised = [], [], [], None
    try:
        for a, b, demand, count, noise, seed in phases:
            rng = random.Random(seed)
            for _ in range(count):
                n = max(1, min(int(ctl.cap), demand))
                t = (a + b * n) * (1 + noise * (2 * rng.random() - 1))
                steps.append([n, t])
                d = ctl.observe(n, t)
                decisions.append(None if d is None else
                                 [d.old_cap, d.new_cap, d.step_ms, d.fixed_ms, d.per_token_ms])
                caps.append(ctl.cap)
        described = ctl.describe().get("batch_cap")
    except NotImplementedError:
        raise
    except Exception as e:      # noqa: BLE001 - judged by the grader, with the steps that led here
        raised, described = f"{type(e).__name__}: {e}", None
    return {"caps": caps, "decisions": decisions, "steps": steps, "raised": raised,
            "described": described}


def drive(student, target, ceiling, *phases) -> dict:
    got = student.run(probe_drive, target, ceiling, list(phases))
    if got["raised"]:
        last = got["steps"][-3:]
        sizes = {n for n, _ in got["steps"]}
        why = "" if len(sizes) != 1 else (
            f" (every step so far had {sizes.pop()} tokens: with no spread in n the slope "
            "cannot be fitted; the fit falls back to b = t / n, a = 0 while no fit came before)")
        raise AssertionError(f"TPOTController raised {got['raised']} after the steps (tokens, ms) "
                             f"{[(n, round(t, 3)) for n, t in last]}{why}")
    caps = got["caps"]
    bad = [c for c in caps if isinstance(c, bool) or not isinstance(c, int)]
    assert not bad, f"the cap is a number of tokens (an int), got {bad[0]!r}"
    out = [(i, c) for i, c in enumerate(caps) if not 1 <= c <= ceiling]
    assert not out, (
        f"step {out[0][0]}: cap {out[0][1]}: the cap stays within [1, ceiling = {ceiling}] "
        "(the ceiling is the config's max_num_batched_tokens; below 1 nobody would be scheduled)")
    return got


SETTLE_CASES = [(5.0, 1.0, 40.0, 1024), (0.0, 0.25, 20.0, 2048), (12.0, 0.05, 60.0, 4096),
                (2.0, 3.0, 100.0, 512), (30.0, 0.5, 45.0, 64), (8.0, 0.01, 30.0, 8192),
                (1.0, 0.7, 200.0, 100)]


def test_the_cap_settles_on_the_widest_batch_within_the_target(student):
    """Exact step costs, demand unlimited: by step 10 the cap stops moving, for 70 more steps,
    within 2% (or a token) of the widest batch predicted within 0.95 * target, and a step at
    the cap is within the target."""
    for a, b, target, ceiling in SETTLE_CASES:
        caps = drive(student, target, ceiling, (a, b, 10_000, 80, 0.0, 0))["caps"]
        best = best_cap(a, b, target, ceiling)
        moves = sum(x != y for x, y in zip(caps[10:], caps[11:]))
        assert moves == 0, (
            f"step = {a} + {b} * tokens ms, target {target} ms: the cost never changes, yet the "
            f"cap still moved {moves} times after step 10 (it oscillates: a feedback rule such "
            f"as halve-when-over, +1-when-under never settles; fit the cost instead): "
            f"caps {caps[8:30]}...")
        assert best - max(1, best // 50) <= caps[-1] <= best, (
            f"step = {a} + {b} * tokens ms, target {target} ms, ceiling {ceiling}: the widest "
            f"batch within 0.95 * target is {best} tokens; the cap settled at {caps[-1]}")
        if best > 1:
            assert a + b * caps[-1] <= target, f"a step at the cap ({caps[-1]}) misses the target"


def test_steady_steps_of_one_size_fall_back_to_t_over_n(student):
    """A steady decode batch of 10 tokens, 15 ms a step, target 40 ms: n has no spread, so
    b = 15 / 10 and a = 0 (no fit came before), and the cap is floor(0.95 * 40 / 1.5) = 25
    after the first step."""
    got = drive(student, 40.0, 1024, (5.0, 1.0, 10, 12, 0.0, 0))
    assert got["caps"][0] == 25 and set(got["caps"]) == {25}, (
        "steps of 10 tokens in 15 ms (no spread in n): the fit falls back to b = t / n = 1.5 "
        f"ms per token, a = 0, and the cap to floor(0.95 * 40 / 1.5) = 25; got caps {got['caps']}")


def test_the_cap_stays_within_one_and_the_ceiling(student):
    """Steps so cheap that thousands of tokens would fit (ceiling 64), and a target no step can
    meet (50 ms fixed, target 10 ms): every cap within [1, ceiling] (``drive`` checks each), and
    the cap ends at the ceiling, and at 1."""
    cheap = drive(student, 100.0, 64, (0.5, 0.01, 10_000, 30, 0.0, 0))
    assert cheap["caps"][-1] == 64, f"cheap steps: the cap is the ceiling, got {cheap['caps'][-1]}"
    dear = drive(student, 10.0, 256, (50.0, 1.0, 10_000, 30, 0.0, 0))
    assert dear["caps"][-1] == 1, f"an impossible target: the cap is 1, got {dear['caps'][-1]}"


NOISE_CASES = [(5.0, 1.0, 40.0, 1024), (5.0, 0.5, 50.0, 1024), (3.0, 0.1, 30.0, 2048)]


def test_measurement_noise_does_not_move_the_batch_back_and_forth(student):
    """Step times within ±1% of a + b * tokens (seeded): after 20 steps the cap moves at most
    twice in 180 steps, and never back the way it came (a cap that narrows and widens again on
    noise changes every request's step time for nothing: widen only by more than a token or 2%)."""
    for a, b, target, ceiling in NOISE_CASES:
        for seed in range(3):
            got = drive(student, target, ceiling, (a, b, 10_000, 200, 0.01, seed))
            caps = got["caps"][20:]
            moves = [y - x for x, y in zip(caps, caps[1:]) if y != x]
            back = sum((p > 0) != (q > 0) for p, q in zip(moves, moves[1:]))
            assert len(moves) <= 2 and back == 0, (
                f"step = {a} + {b} * tokens ms ±1% (seed {seed}), target {target} ms: after "
                f"settling, the cap moved {len(moves)} times ({back} times back the way it "
                f"came): it oscillates on measurement noise; narrow at once but widen only by "
                f"more than a token or 2%: caps {caps[:40]}...")
            best = best_cap(a, b, target, ceiling)
            assert caps[-1] >= 0.9 * best, (
                f"step = {a} + {b} * tokens ms ±1%: the cap fell to {caps[-1]}, the widest "
                f"batch within the target is about {best}")


def test_the_cap_follows_the_cost_both_ways(student):
    """Target 50 ms: 5 + 1 * n for 20 steps (the widest: 42), then 5 + 0.25 * n for 30 (170),
    then 5 + 2 * n for 10 (21). Narrowing is at once: at most 3 steps over the target after the
    cost doubles (the one that finds the change, and two while the fit takes it in)."""
    got = drive(student, 50.0, 1024, (5.0, 1.0, 1000, 20, 0.0, 0), (5.0, 0.25, 1000, 30, 0.0, 0),
                (5.0, 2.0, 1000, 10, 0.0, 0))
    caps, steps = got["caps"], got["steps"]
    assert caps[19] == 42, f"5 + 1 * n ms, target 50: the cap is 42 after 20 steps, got {caps[19]}"
    assert 170 - 170 // 50 - 1 <= caps[49] <= 170, (
        f"the steps got 4 times cheaper (5 + 0.25 * n ms): within 30 steps the cap widens to "
        f"about 170, got {caps[49]} (caps {caps[20:50]}): old steps must fade from the fit "
        f"(weight alpha on the newest) and the cap widen to what the fit allows, not a token a "
        f"step")
    over = [round(t, 1) for _, t in steps[50:] if t > 50.0]
    assert len(over) <= 3 and caps[-1] == 21, (
        f"the steps got 8 times dearer (5 + 2 * n ms): narrow at once; {len(over)} steps "
        f"missed the 50 ms target ({over}), the cap ended at {caps[-1]} (want 21): caps "
        f"{caps[49:]}")


def test_a_decision_is_returned_exactly_when_the_cap_moves(student):
    got = drive(student, 50.0, 1024, (5.0, 1.0, 1000, 20, 0.0, 0), (5.0, 0.25, 1000, 30, 0.01, 3),
                (5.0, 2.0, 1000, 10, 0.0, 0))
    before = [1024] + got["caps"][:-1]
    for i, (old, new, d, (n, t)) in enumerate(zip(before, got["caps"], got["decisions"],
                                                  got["steps"])):
        if new == old:
            assert d is None, f"step {i}: the cap stayed {old}, yet observe returned {d}"
            continue
        assert d is not None, f"step {i}: the cap moved {old} -> {new}: observe returns a " \
                              "BatchDecision (the scheduler emits it as a 'controlled' event)"
        assert d[:2] == [old, new] and math.isclose(d[2], t), (
            f"step {i}: BatchDecision(old_cap, new_cap, step_ms, ...) should be ({old}, {new}, "
            f"{t:.3f}), got {d[:3]}")
        assert d[3] >= 0 and d[4] > 0, f"step {i}: the fit's (a, b) in the decision: {d[3:]}"
    assert got["described"] == got["caps"][-1], "describe()['batch_cap'] is the cap"


JUNK = [(0, 50.0, "a step of no tokens"), (0, 0.0, "a step of no tokens"),
        (-4, 30.0, "a negative number of tokens"), (12, -5.0, "a negative time"),
        (12, float("nan"), "a time that is NaN"), (12, float("inf"), "an infinite time")]


def probe_junk(target: float, ceiling: int, cost: tuple, junk: tuple, at: list) -> dict:
    """Steps of ``min(cap, 60)`` tokens billed ``a + b * tokens`` (and after step 5 twice that,
    so that the fit keeps moving), with ``observe(*junk)`` told before each step of ``at``; and
    the same steps without the junk. What observe returned for the junk, and both runs' caps,
    decisions and ``describe()``."""
    def run(with_junk: bool) -> dict:
        ctl, caps, decisions, answers = TPOTController(target, ceiling), [], [], []
        a, b = cost
        for i in range(24):
            if with_junk and i in at:
                before = ctl.cap
                d = ctl.observe(*junk)
                answers.append([d is not None, before, ctl.cap])
            n = max(1, min(int(ctl.cap), 60))
            d = ctl.observe(n, (a + b * n) * (2.0 if i >= 5 else 1.0))
            decisions.append(None if d is None else [d.old_cap, d.new_cap])
            caps.append(ctl.cap)
        return {"caps": caps, "decisions": decisions, "answers": answers,
                "described": {k: v for k, v in ctl.describe().items()
                              if isinstance(v, (int, float))}}
    try:
        return {"clean": run(False), "junk": run(True), "raised": None}
    except NotImplementedError:
        raise
    except Exception as e:      # noqa: BLE001 - judged by the grader
        return {"raised": f"{type(e).__name__}: {e}"}


@pytest.mark.parametrize("junk", JUNK, ids=[f"{n}-tokens-{t}-ms" for n, t, _ in JUNK])
def test_steps_of_no_tokens_or_a_bad_time_are_ignored(student, junk):
    """``observe(num_tokens, step_ms)`` ignores a step of no tokens (an idle step), a negative
    count, and a time that is negative or not finite (a clock that stepped back, a failed
    measure): nothing folded into the fit, no decision, the cap unchanged, and every later cap
    as if it had never been told (after the first step, and in the middle of a run)."""
    n, t, what = junk
    got = student.run(probe_junk, 40.0, 1024, (5.0, 1.0), (n, t), [1, 9, 10])
    call = f"observe({n}, {t})"
    assert got["raised"] is None, (
        f"{call} ({what}) raised {got['raised']}: such a step is ignored (return None, nothing "
        "folded into the fit): a NaN in the moments makes every later fit NaN")
    clean, junky = got["clean"], got["junk"]
    for decided, before, after in junky["answers"]:
        assert not decided and after == before, (
            f"{call} ({what}) moved the cap {before} -> {after}: such a step is ignored (return "
            "None, the cap and the fit as they were)")
    assert junky["caps"] == clean["caps"] and junky["decisions"] == clean["decisions"], (
        f"{call} ({what}), told three times among 24 steps, changed the caps that followed: "
        f"{junky['caps']} instead of {clean['caps']}: it was folded into the fit; a step of no "
        "tokens, or with a time that is negative or not finite, is ignored")
    assert junky["described"] == clean["described"], (
        f"{call} ({what}) changed the fit: describe() {junky['described']} instead of "
        f"{clean['described']}")


def probe_engine(target: float, cost: tuple) -> dict:
    """A burst of 40 requests (16-token prompts, 24 tokens each) in groups of 8, one group per
    step, 64 seats, through the real engine computing nothing, each step billed a + b * tokens."""
    from minillm.engines.r12_realtime.sim import sim_engine, sim_request, simulate
    engine = sim_engine("fcfs", cost, max_num_seqs=64, batch_controller="tpot",
                        tpot_target_ms=target)
    events = []
    engine.observers.add(lambda e: events.append([e.data.old_cap, e.data.new_cap]), ("controlled",))
    run = simulate(engine, [(i // 8, sim_request(f"r{i}", 16, 24)) for i in range(40)])
    bm = engine.block_manager
    return {"tokens": [s["tokens"] for s in run.steps], "events": events,
            "cap": engine.scheduler.controller.cap, "ends": run.ends,
            "full": bm.num_free_blocks == bm.num_blocks}


def test_the_engine_holds_the_target(student):
    """The burst of ``probe_engine``, step = 5 + 1 * tokens ms, target 40 ms: a fixed batch of 64
    seats runs steps of over 120 ms; with the controller every step after the first two (the fit
    needs them) is within 40 ms, the cap settles at 33, and every request ends once."""
    target, (a, b) = 40.0, (5.0, 1.0)
    got = student.run(probe_engine, target, (a, b))
    late = [(i, a + b * n) for i, n in enumerate(got["tokens"]) if n and i >= 2
            and a + b * n > target]
    assert not late, f"steps over the {target} ms target after the first two: {late[:5]}"
    assert got["cap"] == 33 and got["events"] and got["events"][-1][1] == 33, \
        f"the cap settles at 33 (the 'controlled' events: {got['events']}, cap {got['cap']})"
    chain = [1024] + [new for _, new in got["events"]]
    assert [old for old, _ in got["events"]] == chain[:-1], \
        f"each decision's old_cap is the previous decision's new_cap: {got['events']}"
    assert len(got["ends"]) == 40 and set(got["ends"].values()) == {1}, \
        "every request ends, once"
    assert got["full"], "the pool must end full"


def probe_overload(steps: int = 120) -> dict:
    """Two requests of 8 + 32 tokens every step (80 tokens of work a step), step = 20 + 0.5 *
    tokens ms, target 40 ms (whose batch, 36 tokens, cannot keep up), ``tpot_overload="widen"``:
    the controller widens to about 88 tokens, the narrowest batch serving 1.1 x the arrivals."""
    from minillm.engines.r12_realtime.sim import sim_engine, sim_request, simulate
    engine = sim_engine("fcfs", (20.0, 0.5), num_blocks=4096, max_num_seqs=256,
                        batch_controller="tpot", tpot_target_ms=40.0, tpot_overload="widen")
    run = simulate(engine, [(k // 2, sim_request(f"r{k}", 8, 32)) for k in range(2 * steps)])
    return {"caps": [s["cap"] for s in run.steps]}


def test_a_steady_batch_keeps_what_the_fit_knows(student):
    """Under ``probe_overload`` the batch is steady at its cap, so the sizes lose their spread and
    ``_fit`` falls back. If the fallback forgets the fixed part (a = 0), a wider batch looks no
    faster per token than a narrow one, "widen" sees no reason to stay wide, and the cap swings
    between about 52 and 90 every twenty steps; kept, it settles."""
    caps = student.run(probe_overload)["caps"][80:120]
    assert max(caps) - min(caps) <= 6, (
        f"steps 80-120 of a steady overload: the cap swings between {min(caps)} and {max(caps)} "
        f"({caps}); with no spread of sizes, does _fit keep the last fit's a (if below E[t]) "
        "and set b = (E[t] - a) / E[n]?")
