"""Scheduling policies (core/policy.py, notebook 08). The behaviour — urgent preemption for a full
batch and for a full pool, the threshold, the starvation bound under ``score`` on a stream that
starves ``priority``, no ping-pong evictions, tokens equal FCFS's — is exercise 08's grader, run
here on the package's own code (its tests are imported below); this module adds the config, HTTP,
keys that stay finite for every accepted request and admission in O(log n) key
computations per request, in the order a full sort gives."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, Request, SamplingParams
from minillm.checks import FIELD_RANGES
from minillm.core.block_manager import BlockManager
from minillm.engines import build_components
from minillm.engines.r8_policies.config import PolicyConfig
from minillm.core.policy import FCFS
from minillm.engines.r8_policies.policy import MAX_SCORE_WEIGHT, Priority, Score, get_policy
from minillm.core.scheduler import Scheduler, SchedulerOutput
from minillm.core.sequence import Sequence, SequenceGroup
from minillm.request import RequestError


def make_policy(**options):
    """The policy the registry gives the paged engine for these options (FCFS: none given)."""
    return build_components(options).get("policy", FCFS())


def test_config_fields_are_checked_and_reach_the_policy():
    assert make_policy(policy="score", score_wait_weight=2, score_remaining_weight=0.5,
                       score_priority_weight=7, score_margin=1) == Score(2.0, 0.5, 7.0, 1.0)
    assert make_policy(policy="priority", priority_preemption_threshold=3) == Priority(3)
    assert make_policy() == FCFS()
    for field, value, why in [("score_wait_weight", -1.0, ">= 0"),
                              ("score_margin", float("nan"), "finite"),
                              ("score_priority_weight", "high", "must be a number"),
                              ("priority_preemption_threshold", -1, ">= 0")]:
        with pytest.raises(ValueError, match=f"{field}.*{why}|{field} must"):
            PolicyConfig(**{field: value})
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        get_policy("lifo")
    with pytest.raises(ValueError, match="no starvation bound"):
        Score(wait_weight=0).overtake_horizon(None, 0)


def test_priority_over_http_labels_metrics_and_reaches_the_scheduler(tiny):
    """``priority`` on both endpoints (vLLM's extra): it reaches the request, /metrics has TTFT and
    TPOT histograms per class, a 17th class shares "other", and a bad value is a 400 naming it."""
    import httpx
    from serve_util import running_server

    from minillm.serve.metrics import MAX_CLASSES

    llm = LLM(tiny, engine="paged", num_blocks=96, max_num_seqs=4, policy="priority")
    seen: list[int] = []
    with running_server(llm, max_waiting=64) as (url, app):
        app.state.loop.on_step.append(
            lambda loop, out: seen.extend(r.priority for r in out.finished))
        body = {"model": "tiny-llama", "max_tokens": 3, "temperature": 0}
        for p in [*range(MAX_CLASSES), 99, -5]:
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "hi", "priority": p},
                           timeout=60)
            assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            **body, "messages": [{"role": "user", "content": "hi"}], "priority": 3})
        assert r.status_code == 200, r.text
        for bad in ("high", 1.5, 1 << 40):
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "x", "priority": bad},
                           timeout=60)
            assert r.status_code == 400 and "priority" in r.text, (bad, r.text)
        text = httpx.get(f"{url}/metrics", timeout=30).text
    assert sorted(seen) == sorted([*range(MAX_CLASSES), 99, -5, 3])
    counts = {line.split('priority="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines()
              if line.startswith("minillm:time_to_first_token_by_priority_seconds_count")}
    assert counts == {**{str(p): 1.0 for p in range(MAX_CLASSES) if p != 3}, "3": 2.0,
                      "other": 2.0}
    assert "minillm:time_per_output_token_by_priority_seconds_bucket" in text


# --- no accepted request can make a policy's arithmetic fail -------------------------------------
def group_of(priority=0, max_tokens=16, generated=0, arrival_index=0, arrival_step=0):
    req = Request([1, 2], SamplingParams(max_tokens=max_tokens), priority=priority)
    return SequenceGroup(req, [Sequence(req, [1, 2] + [3] * generated, 2)], arrival_index,
                         arrival_step)


def extremes(lo, hi):
    """Any integer in [lo, hi], the ends and their neighbours most often."""
    return st.one_of(st.sampled_from([lo, lo + 1, hi - 1, hi, max(lo, min(hi, 0))]),
                     st.integers(lo, hi))


WEIGHTS = st.one_of(st.sampled_from([0.0, 5e-324, 1.0, MAX_SCORE_WEIGHT]),
                    st.floats(0.0, MAX_SCORE_WEIGHT))
POLICY_OBJECTS = st.one_of(
    st.just(FCFS()), st.builds(Priority, extremes(0, 2**63)),
    st.builds(Score, WEIGHTS, WEIGHTS, WEIGHTS, st.one_of(WEIGHTS, st.just(1e308))))
GROUPS = st.builds(group_of, extremes(*FIELD_RANGES["priority"]),
                   extremes(*FIELD_RANGES["max_tokens"]), st.integers(0, 3),
                   extremes(0, 2**63 - 1), extremes(0, 2**63 - 1))


@settings(max_examples=400, deadline=None)
@given(policy=POLICY_OBJECTS, a=GROUPS, b=GROUPS)
def test_every_policy_ranks_the_extreme_accepted_requests(policy, a, b):
    """key() and preempts() return for any request the checks accept (priority and max_tokens at
    their int32 ends, steps up to 2**63) and any weights the config accepts; every key is finite,
    so keys compare and differences never turn into inf - inf = nan."""
    for g in (a, b):
        key = policy.key(g)
        assert all(math.isfinite(k) for k in key), (policy, key)
    assert sorted([policy.key(a), policy.key(b)]) is not None
    assert isinstance(policy.preempts(a, b), bool) and isinstance(policy.preempts(b, a), bool)


def test_score_weights_are_bounded():
    top = dict(score_wait_weight=MAX_SCORE_WEIGHT, score_remaining_weight=MAX_SCORE_WEIGHT,
               score_priority_weight=MAX_SCORE_WEIGHT, score_margin=1e308)
    policy = make_policy(policy="score", **top)
    lo, hi = FIELD_RANGES["priority"]
    keys = [policy.key(group_of(p, FIELD_RANGES["max_tokens"][1], 0, 0, 2**63 - 1))
            for p in (lo, hi)]
    assert all(math.isfinite(k[0]) for k in keys) and keys[0] < keys[1]
    for name in ("score_wait_weight", "score_remaining_weight", "score_priority_weight"):
        with pytest.raises(ValueError, match=f"{name} must be <= 1e\\+09, got 10000000000.0"):
            PolicyConfig(**{name: 1e10})
    with pytest.raises(ValueError, match=r"score: priority_weight must be in \[0, 1e\+09\]"):
        Score(priority_weight=2e9)
    with pytest.raises(ValueError, match="wait_weight must be a finite number, got inf"):
        Score(wait_weight=math.inf)


class Fragile:
    """Somebody's policy with a bug: its key raises for one request."""

    name = "fragile"

    def key(self, group):
        if group.request.request_id == "bad":
            raise OverflowError("int too large to convert to float")
        return (group.arrival_index,)

    def preempts(self, candidate, victim):
        return False


def test_a_key_that_raises_fails_its_own_request_at_admission():
    sched = Scheduler(BlockManager(16, 4), policy=Fragile())
    a = sched.add(Request([1, 2], request_id="a"))
    with pytest.raises(RequestError, match="bad: the 'fragile' policy cannot rank this request "
                                           r"\(OverflowError: int too large"):
        sched.add(Request([1, 2], request_id="bad"))
    b = sched.add(Request([1, 2], request_id="b"))
    assert sched.waiting == [a, b] and set(sched.groups) == {"a", "b"}
    assert [g.arrival_index for g in sched.waiting] == [0, 1]
    bad = Request([1, 2], request_id="late")
    bad.priority = 10**400          # assigned after construction, as the CLI does
    with pytest.raises(RequestError, match=r"late: priority must be an integer in "
                                           r"\[-2147483648, 2147483647\], got an integer of "
                                           r"401 digits"):
        sched.add(bad)
    assert sched.waiting == [a, b] and "late" not in sched.groups


# --- admission costs O(log n) key computations, in the order a sort gives ------------------------
class Counting:
    """``inner`` with its key() calls counted."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, 0

    def key(self, group):
        self.calls += 1
        return self.inner.key(group)

    def preempts(self, candidate, victim):
        return self.inner.preempts(candidate, victim)


class ClassOnly:
    """Priority without the arrival tie-break: equal keys, whose order the queue must keep."""

    name = "class-only"

    def key(self, group):
        return (group.request.priority,)

    def preempts(self, candidate, victim):
        return False


@pytest.mark.parametrize("inner", [ClassOnly(), Priority(), Score()], ids=lambda p: p.name)
def test_admission_is_n_log_n_key_computations(inner):
    n, rng = 10_000, random.Random(38)
    policy = Counting(inner)
    sched = Scheduler(BlockManager(16, 4), policy=policy)
    for i in range(n):
        sched.add(Request([1, 2, 3], SamplingParams(max_tokens=rng.randint(1, 64)),
                          request_id=f"r{i}", priority=rng.randint(-3, 3)))
    # re-sorting on every add would compute ~n**2 / 2 keys (5e7 here); insertion ~log2(k) per add
    assert policy.calls <= 1.5 * n * math.log2(n), policy.calls
    arrived = sorted(sched.groups.values(), key=lambda g: g.arrival_index)
    assert sched.waiting == sorted(arrived, key=inner.key)    # stable: ties in arrival order


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "admit", "preempt"]), st.integers(0, 2)),
                    max_size=60))
def test_queue_order_is_the_old_full_sorts(ops):
    """Whatever the arrivals, admissions and preemptions, the queue is exactly what appending and
    stable-sorting gives (an arrival after its equals), and inserting at the front and
    stable-sorting (a preempted group before its equals)."""
    sched = Scheduler(BlockManager(16, 4), policy=ClassOnly())
    old: list = []
    for i, (op, priority) in enumerate(ops):
        if op == "add":
            g = sched.add(Request([1, 2], request_id=f"r{i}", priority=priority))
            old.append(g)
            old.sort(key=ClassOnly().key)
        elif op == "admit" and sched.waiting:
            sched.running.append(sched.waiting.pop(0))
            old.pop(0)
        elif op == "preempt" and sched.running:
            victim = sched.running[-priority % len(sched.running)]
            sched.preempt(victim, SchedulerOutput([], [], []))
            old.insert(0, victim)
            old.sort(key=ClassOnly().key)
        assert sched.waiting == old


def test_a_preempted_group_goes_before_its_equals():
    sched = Scheduler(BlockManager(16, 4), policy=ClassOnly())
    first = sched.add(Request([1, 2], request_id="first", priority=1))
    sched.running.append(sched.waiting.pop(0))
    later = [sched.add(Request([1, 2], request_id=f"r{p}{i}", priority=p))
             for i, p in enumerate([1, 1, 0, 2])]
    sched.preempt(first, SchedulerOutput([], [], []))
    assert [g.request.request_id for g in sched.waiting] == ["r02", "first", "r10", "r11", "r23"]
    assert sched.waiting[1] is first and later[2] is sched.waiting[0]



def first_token_under_a_steady_stream(policy: str, arrive_at: int, horizon: int, seats: int = 4,
                                      max_tokens: int = 4) -> tuple[int | None, dict]:
    """One priority-0 request per step (4-token prompts, ``max_tokens`` each: as many steps as
    tokens, so ``seats`` seats serve exactly that rate and the queue never empties) and one
    priority-10 request at step ``arrive_at``, for at most ``horizon`` steps on the real
    scheduler (a model that computes nothing). Returns the step of the priority-10 request's
    first token (None: none by ``horizon``) and the step each request was first scheduled."""
    from minillm.lab.graders.test_08 import Sim

    sim = Sim(num_blocks=512, block_size=4, budget=64, max_seqs=seats, policy=policy)
    low = None
    for step in range(horizon):
        if step == arrive_at:
            low = sim.add("low", max_tokens=max_tokens, priority=10)
        sim.add(f"r{step}", max_tokens=max_tokens, priority=0)
        sim.run_step()
        if low is not None and low.output_token_ids:
            return step, sim.first_scheduled
    return None, sim.first_scheduled


def test_score_defaults_serve_a_priority_10_request_within_a_few_hundred_steps():
    """The bound of core/policy.py's docstring with the default weights, on the step clock: a
    request 10 levels behind a steady stream of priority-0 requests gets its first token within
    D + ceil(|ahead| / S) * L steps, a few hundred; under ``priority`` the same stream starves
    it."""
    policy, seats, max_tokens, a = Score(), 4, 4, 20
    d = policy.overtake_horizon(group_of(priority=10, max_tokens=max_tokens, arrival_step=a), 0)
    # ahead: the seats and the queue it found (the stream's rate is what the seats serve, so at
    # most a batch of each) and the D arrivals after it; L = max_tokens steps each
    bound = d + math.ceil((2 * seats + d) / seats) * max_tokens
    assert bound <= 500, f"the default weights' bound is {bound} steps: not a few hundred"
    first, scheduled = first_token_under_a_steady_stream("score", a, a + bound + 1, seats,
                                                         max_tokens)
    assert first is not None and first - a <= bound, \
        f"the priority-10 request's first token: step {first}, bound {a + bound}"
    # newer priority-0 requests overtook it until D: aging is what served it
    assert any(int(r[1:]) > a and t < first for r, t in scheduled.items() if r != "low")
    starved, _ = first_token_under_a_steady_stream("priority", a, a + bound + 1, seats,
                                                   max_tokens)
    assert starved is None
