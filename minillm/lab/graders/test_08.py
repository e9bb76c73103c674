"""Exercise 08 — the scheduling policies: ``Priority.key``, ``Priority.preempts``,
``remaining_tokens``, ``Score.score`` and ``Score.preempts`` (``minillm/core/policy.py``).

Graded on behaviour, with the real scheduler and block manager (a model that computes nothing,
counting steps, never seconds) and then the real engine: an urgent request gets the next step
when the batch is full and when the pool is full; classes within the threshold never evict each
other; ``score`` admits a starved request within the bound of the module's docstring on a stream
that starves ``priority``; random streams finish with no leaks and no ping-pong evictions; and the
tokens of every request equal FCFS's (a policy changes the order, never the outputs). The
package's own tests run these same checks (``tests/test_policy.py``).
"""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.core.block_manager import BlockManager
from minillm.core.policy import Priority, Score, get_policy
from minillm.core.runner import reaching_end, step_order
from minillm.core.scheduler import Scheduler, SchedulerOutput
from minillm.lab.checks import check_block_invariants
from minillm.request import Request


def fake_step(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    order = step_order(out.scheduled)
    reached = [order[k][0] for k in reaching_end(order)]
    sched.commit_computed(out)
    return sched.postprocess([(s, 1) for _, s in sched.rows_to_sample(reached)], [])


class Sim:
    """A scheduler, a clock in steps, and every event: when each request was first scheduled,
    and each eviction for priority (step, victim, candidate)."""

    def __init__(self, num_blocks=64, block_size=4, budget=64, max_seqs=4, policy="fcfs"):
        self.bm = BlockManager(num_blocks, block_size)
        self.evictions: list[tuple[int, str, str]] = []
        self.sched = Scheduler(self.bm, budget, max_seqs, get_policy(policy),
                               emit=self._emit)
        self.step, self.first_scheduled, self.done = 0, {}, []

    def _emit(self, phase, request_id=None, data=None):
        if phase == "preempted":
            self.evictions.append((self.step, request_id, data))

    def add(self, rid, prompt_len=4, max_tokens=4, priority=0):
        req = Request([7] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      request_id=rid, priority=priority)
        self.sched.add(req)
        return req

    def run_step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        for seq, _ in out.scheduled:
            self.first_scheduled.setdefault(seq.request.request_id, self.step)
        evicted_now = {v for s, v, _ in self.evictions if s == self.step}
        assert not evicted_now & {s.request.request_id for s, _ in out.scheduled}, \
            "a request evicted for priority is not scheduled again in the same step"
        self.done += fake_step(self.sched, out)
        check_block_invariants(self.bm, self.sched.live_seqs())
        self.step += 1
        return out


@pytest.mark.parametrize("policy", ["fcfs", "priority", "score"])
def test_urgent_arrival_with_the_batch_full(policy):
    """Two low-priority requests hold both seats (max_num_seqs=2) with room in the pool; an urgent
    one arrives. Under ``priority`` and ``score`` it is scheduled on the next step (bound: 1 step,
    its prompt fits the budget); under ``fcfs`` it waits for a seat."""
    sim = Sim(max_seqs=2, policy=policy)
    for rid in ("low0", "low1"):
        sim.add(rid, max_tokens=60, priority=5)
    for _ in range(3):
        sim.run_step()
    sim.add("urgent", priority=0)
    arrival = sim.step
    sim.run_step()
    if policy == "fcfs":
        assert "urgent" not in sim.first_scheduled and not sim.evictions
    else:
        assert sim.first_scheduled["urgent"] == arrival
        assert [(s, v, c) for s, v, c in sim.evictions] == [(arrival, "low1", "urgent")]
    while sim.sched.has_unfinished():
        sim.run_step()
    assert len(sim.done) == 3 and sim.bm.num_free_blocks == sim.bm.num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_urgent_arrival_with_the_pool_full(policy):
    """Seats are free but the pool is not: two low-priority requests fill all 8 blocks. The urgent
    arrival evicts the lowest-ranked one under ``priority`` and is scheduled on the next step."""
    sim = Sim(num_blocks=8, block_size=4, max_seqs=4, policy=policy)
    sim.add("low0", prompt_len=14, max_tokens=2, priority=5)
    sim.add("low1", prompt_len=14, max_tokens=2, priority=5)
    sim.run_step()
    assert sim.bm.num_free_blocks == 0
    sim.add("urgent", prompt_len=8, priority=0)
    arrival = sim.step
    sim.run_step()
    if policy == "priority":
        assert sim.first_scheduled["urgent"] == arrival
        assert sim.evictions == [(arrival, "low1", "urgent")]
        assert sim.sched.groups["low1"].request.num_preemptions == 1
    else:
        assert "urgent" not in sim.first_scheduled
    while sim.sched.has_unfinished():
        sim.run_step()
    assert sorted(r.request_id for r in sim.done) == ["low0", "low1", "urgent"]
    assert sim.bm.num_free_blocks == 8


def test_threshold_keeps_near_classes_from_evicting_each_other():
    sim = Sim(max_seqs=1, policy=Priority(threshold=1))
    sim.add("p2", max_tokens=10, priority=2)
    sim.run_step()
    sim.add("p1", priority=1)          # 2 - 1 = 1: not more than the threshold
    sim.run_step()
    assert "p1" not in sim.first_scheduled and not sim.evictions
    sim.add("p0", priority=0)          # 2 - 0 = 2 > 1: evicts
    sim.run_step()
    assert sim.evictions == [(2, "p2", "p0")]


def adversarial(policy, horizon: int, max_seqs=2, max_tokens=4, prompt_len=4):
    """One low-priority request, then one urgent request arriving every step, for ``horizon``
    steps (an arrival rate no batch of ``max_seqs`` seats keeps up with)."""
    sim = Sim(num_blocks=256, max_seqs=max_seqs, policy=policy)
    arrivals = {}
    for t in range(horizon):
        if t == max_seqs:           # the seats are taken by then
            low = sim.add("low", prompt_len=prompt_len, max_tokens=max_tokens, priority=1)
            arrivals["low"] = sim.step
            if isinstance(policy, Score):   # the bound's D, from what the request is on arrival
                arrivals["D"] = policy.overtake_horizon(sim.sched.groups["low"], min_priority=0)
        rid = f"urgent{t}"
        sim.add(rid, prompt_len=prompt_len, max_tokens=max_tokens, priority=0)
        arrivals[rid] = sim.step
        sim.run_step()
        if "low" in sim.first_scheduled:
            break
    return sim, low, arrivals


def test_priority_starves_the_low_request_under_a_steady_urgent_stream():
    sim, *_ = adversarial("priority", horizon=300)
    assert "low" not in sim.first_scheduled


@pytest.mark.parametrize("weights", [(1.0, 0.1, 1000.0, 10.0), (0.5, 1.0, 20.0, 0.0),
                                     (2.0, 0.0, 300.0, 50.0)])
def test_score_admits_the_low_request_within_its_bound(weights):
    """The bound of core/policy.py's docstring: D = overtake_horizon; the requests that can rank
    ahead arrived by step D; with S seats and L steps each, admission by D + ceil(ahead/S) * L."""
    policy = Score(*weights)
    max_seqs, max_tokens, prompt_len = 2, 4, 4
    d = (policy.priority_weight + policy.remaining_weight * max_tokens + policy.margin) \
        / policy.wait_weight                        # D for the low request, one arrival per step
    horizon = int(max_seqs + d + ((max_seqs + d) / max_seqs + 2) * (1 + max_tokens)) + 50
    sim, low, arrivals = adversarial(policy, horizon=horizon, max_seqs=max_seqs,
                                     max_tokens=max_tokens, prompt_len=prompt_len)
    assert "low" in sim.first_scheduled, "starved under score"
    a = arrivals["low"]
    horizon = arrivals.pop("D")
    ahead = sum(1 for rid, t in arrivals.items() if rid != "low" and t <= a + horizon)
    steps_each = 1 + max_tokens          # one prompt chunk (it fits the budget), then decodes
    bound = a + horizon + math.ceil(ahead / max_seqs) * steps_each
    assert sim.first_scheduled["low"] <= bound
    # aging is what admitted it: the same stream starves it under priority for as long
    starved, *_ = adversarial("priority", horizon=sim.first_scheduled["low"] + 1)
    assert "low" not in starved.first_scheduled


@settings(max_examples=40, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 8),
                               st.integers(0, 3)), min_size=1, max_size=14),
       num_blocks=st.integers(8, 30), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(4, 48), max_seqs=st.integers(1, 6),
       policy=st.sampled_from(["priority", "score", Priority(1), Score(1.0, 1.0, 5.0, 0.0)]))
def test_random_streams_finish_without_thrash_or_leaks(reqs, num_blocks, block_size, budget,
                                                       max_seqs, policy):
    """Every request finishes, the pool ends full, every eviction was one the policy allows, and
    no pair evicts each other back and forth (a candidate never becomes its victim's victim)."""
    sim = Sim(num_blocks, block_size, budget, max_seqs, policy)
    pending = [(t, i, plen, out, prio) for i, (plen, out, t, prio) in enumerate(reqs)
               if -(-(plen + out) // block_size) <= num_blocks]   # the engine rejects the rest
    while pending or sim.sched.has_unfinished():
        for item in [p for p in pending if p[0] <= sim.step]:
            pending.remove(item)
            sim.add(f"r{item[1]}", item[2], item[3], item[4])
        sim.run_step()
        assert sim.step < 3000, "no progress: the scheduler livelocks"
    assert len(sim.done) == len([r for r in reqs if -(-(r[0] + r[1]) // block_size) <= num_blocks])
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in sim.done)
    assert sim.bm.num_free_blocks == num_blocks
    pairs = {(v, c) for _, v, c in sim.evictions}
    assert not {(c, v) for v, c in pairs} & pairs, f"ping-pong evictions: {sim.evictions}"


@pytest.mark.parametrize("policy", ["priority", "score"])
def test_policies_change_the_order_never_the_tokens(tiny, policy):
    """The same requests (greedy, seeded n = 2 samples, beams; shared prefixes), arriving one per
    step, each more urgent than the last, three seats: the policy evicts, and every request's
    outputs equal FCFS's."""
    prefix = list(range(20, 32))
    prompts = [prefix + [40 + i] * (1 + i % 5) for i in range(10)]
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=5, beam_width=2, ignore_eos=True)]

    def run(policy_name):
        llm = LLM(tiny, engine="paged", block_size=4, num_blocks=24, max_num_seqs=3,
                  max_num_batched_tokens=16, enable_prefix_caching=True, policy=policy_name,
                  attention_backend="torch")
        reqs = [Request(p, params[i % 3], request_id=f"q{i}", priority=10 - i)
                for i, p in enumerate(prompts)]
        for r in reqs:                  # one arrival per step, each more urgent than the last
            llm.engine.add_request(r)
            llm.engine.step()
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert llm.engine.block_manager.num_free_blocks == 24
        return {r.request_id: [list(s.token_ids) for s in r.outputs] for r in reqs}, \
            llm.engine.num_preemptions

    base, _ = run("fcfs")
    other, preemptions = run(policy)
    assert preemptions > 0, "the pool was meant to be tight enough to preempt"
    assert other == base
