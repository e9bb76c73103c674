"""Exercise 08 — the scheduling policies: ``Priority.key``, ``Priority.preempts``,
``remaining_tokens``, ``Score.score`` and ``Score.preempts`` (``engines/r8_policies/policy.py``).

Graded on behaviour, with the real scheduler and block manager (a model that computes nothing,
counting steps, never seconds) and then the real engine: an urgent request gets the next step when
the batch is full and when the pool is full; classes within the threshold never evict each other;
``score`` admits a starved request within the bound of the module's docstring on a stream that
starves ``priority``; random streams finish with no leaks and no ping-pong evictions; and the
tokens of every request equal FCFS's (a policy changes the order, never the outputs).

The simulations run in the student's process (``probe_*``, the ``student`` fixture) and send back
what happened (who was scheduled when, who evicted whom, what finished), judged here; the functions
are also asked directly, on groups built to tell the plausible mistakes apart (the first or slowest
sample, finished samples or the prompt counted, ``arrival_index`` for ``arrival_step``, ``>=`` for
``>``, ``preempts``' arguments swapped).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import SamplingParams
from minillm.core.block_manager import BlockManager
from minillm.core.sampler import SamplerOutput as Sampled
from minillm.engines.r8_policies.policy import Priority, Score, get_policy, remaining_tokens
from minillm.core.runner import reaching_end, step_order
from minillm.core.scheduler import Scheduler, SchedulerOutput
from minillm.core.sequence import Sequence, SequenceGroup
from minillm.lab.reference import baseline
from minillm.request import Request

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)


def fake_step(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    order = step_order(out.scheduled)
    reached = [order[k][0] for k in reaching_end(order)]    # (before the K/V are counted)
    sched.update_after_forward(out)
    return sched.update_from_output(Sampled([(s, 1) for _, s in sched.rows_to_sample(reached)], []))


def make_policy(spec):
    """A policy from plain data: a name, or ("Priority", threshold), or ("Score", *weights)."""
    if isinstance(spec, str):
        return get_policy(spec)
    return (Priority if spec[0] == "Priority" else Score)(*spec[1:])


class Sim:
    """A scheduler, a clock in steps, and every event: when each request was first scheduled, each
    eviction for priority (step, victim, candidate), and who was scheduled at each step."""

    def __init__(self, num_blocks=64, block_size=4, budget=64, max_seqs=4, policy="fcfs"):
        self.bm = BlockManager(num_blocks, block_size)
        self.evictions: list[list] = []
        self.sched = Scheduler(self.bm, budget, max_seqs, make_policy(policy), emit=self._emit)
        self.step, self.first_scheduled, self.done, self.steps = 0, {}, [], []

    def _emit(self, phase, request_id=None, data=None):
        if phase == "preempted":
            self.evictions.append([self.step, str(request_id), str(data)])

    def add(self, rid, prompt_len=4, max_tokens=4, priority=0):
        req = Request([7] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      request_id=rid, priority=priority)
        self.sched.add(req)
        return req

    def run_step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        ids = [s.request.request_id for s, _ in out.scheduled]
        for rid in ids:
            self.first_scheduled.setdefault(rid, self.step)
        self.steps.append(ids)
        self.done += fake_step(self.sched, out)
        self.step += 1
        return out

    def finish(self, max_steps: int = 3000) -> None:
        while self.sched.has_unfinished() and self.step < max_steps:
            self.run_step()

    def summary(self) -> dict:
        return {"first": dict(self.first_scheduled), "evictions": self.evictions,
                "steps": self.steps, "step": self.step, "free": self.bm.num_free_blocks,
                "blocks": self.bm.num_blocks, "unfinished": bool(self.sched.has_unfinished()),
                "done": {r.request_id: len(r.output_token_ids) for r in self.done},
                "preemptions": {rid: g.request.num_preemptions
                                for rid, g in self.sched.groups.items()}}


def judged(s: dict) -> dict:
    """What every simulation must show, checked here on what the student's process sent."""
    for step, victim, _ in s["evictions"]:    # evicted for priority, scheduled again that step:
        assert victim not in s["steps"][step], f"step {step}: {victim} evicted and rescheduled"
    assert not s["unfinished"], f"requests still unfinished after {s['step']} steps (livelock?)"
    assert s["free"] == s["blocks"], f"{s['blocks'] - s['free']} blocks leaked: the pool must end full"
    return s


def probe_batch_full(policy) -> dict:
    sim = Sim(max_seqs=2, policy=policy)
    for rid in ("low0", "low1"):
        sim.add(rid, max_tokens=60, priority=5)
    for _ in range(3):
        sim.run_step()
    sim.add("urgent", priority=0)
    sim.run_step()
    sim.finish()
    return sim.summary()


@pytest.mark.parametrize("policy", ["fcfs", "priority", "score"])
def test_urgent_arrival_with_the_batch_full(student, policy):
    """Two low-priority requests hold both seats (max_num_seqs=2) with room in the pool; an urgent
    one arrives. Under ``priority`` and ``score`` it is scheduled on the next step (bound: 1 step,
    its prompt fits the budget); under ``fcfs`` it waits for a seat."""
    sim = judged(student.run(probe_batch_full, policy))
    arrival = 3
    if policy == "fcfs":
        assert sim["first"]["urgent"] > arrival and not sim["evictions"]
    else:
        assert sim["first"]["urgent"] == arrival, "the urgent request waited for a seat"
        assert sim["evictions"] == [[arrival, "low1", "urgent"]], sim["evictions"]
    assert len(sim["done"]) == 3


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_urgent_arrival_with_the_pool_full(student, policy):
    """Seats are free but the pool is not: two low-priority requests fill all 8 blocks. The urgent
    arrival evicts the lowest-ranked one under ``priority`` and is scheduled on the next step."""
    sim = judged(student.run(probe_pool_full, policy))
    assert sim["free_after_first"] == 0
    if policy == "priority":
        assert sim["first"]["urgent"] == 1 and sim["evictions"] == [[1, "low1", "urgent"]]
        assert sim["low1_preemptions"] == 1
    else:
        assert sim["first"]["urgent"] > 1
    assert sorted(sim["done"]) == ["low0", "low1", "urgent"]


def probe_pool_full(policy) -> dict:
    sim = Sim(num_blocks=8, block_size=4, max_seqs=4, policy=policy)
    sim.add("low0", prompt_len=14, max_tokens=2, priority=5)
    sim.add("low1", prompt_len=14, max_tokens=2, priority=5)
    sim.run_step()
    free = sim.bm.num_free_blocks
    sim.add("urgent", prompt_len=8, priority=0)
    sim.run_step()
    low1 = sim.sched.groups.get("low1")
    n = low1.request.num_preemptions if low1 else -1
    sim.finish()
    return sim.summary() | {"free_after_first": free, "low1_preemptions": n}


def probe_threshold() -> dict:
    sim = Sim(max_seqs=1, policy=("Priority", 1))
    sim.add("p2", max_tokens=10, priority=2)
    sim.run_step()
    sim.add("p1", priority=1)          # 2 - 1 = 1: not more than the threshold
    sim.run_step()
    sim.add("p0", priority=0)          # 2 - 0 = 2 > 1: evicts
    sim.run_step()
    return sim.summary()


def test_threshold_keeps_near_classes_from_evicting_each_other(student):
    sim = student.run(probe_threshold)
    assert sim["first"].get("p1", 99) > 1, "p1 is within the threshold of p2: it must not evict it"
    assert sim["evictions"] == [[2, "p2", "p0"]], sim["evictions"]


def probe_adversarial(policy, horizon: int, max_seqs=2, max_tokens=4, prompt_len=4) -> dict:
    """One low-priority request, then one urgent request arriving every step, for ``horizon``
    steps (an arrival rate no batch of ``max_seqs`` seats keeps up with)."""
    sim = Sim(num_blocks=256, max_seqs=max_seqs, policy=policy)
    arrivals = {}
    for t in range(horizon):
        if t == max_seqs:           # the seats are taken by then
            sim.add("low", prompt_len=prompt_len, max_tokens=max_tokens, priority=1)
            arrivals["low"] = sim.step
        rid = f"urgent{t}"
        sim.add(rid, prompt_len=prompt_len, max_tokens=max_tokens, priority=0)
        arrivals[rid] = sim.step
        sim.run_step()
        if "low" in sim.first_scheduled:
            break
    return {"first": dict(sim.first_scheduled), "arrivals": arrivals}


def test_priority_starves_the_low_request_under_a_steady_urgent_stream(student):
    assert "low" not in student.run(probe_adversarial, "priority", horizon=300)["first"]


@pytest.mark.parametrize("weights", [(1.0, 0.1, 1000.0, 10.0), (0.5, 1.0, 20.0, 0.0),
                                     (2.0, 0.0, 300.0, 50.0)])
def test_score_admits_the_low_request_within_its_bound(student, weights):
    """The bound of r8_policies/policy.py's docstring: D = overtake_horizon; the requests that can rank
    ahead arrived by step D; with S seats and L steps each, admission by D + ceil(ahead/S) * L."""
    policy = Score(*weights)            # the reference's, here: D from the definition
    max_seqs, max_tokens, prompt_len = 2, 4, 4
    d = (policy.priority_weight + policy.remaining_weight * max_tokens + policy.margin) \
        / policy.wait_weight                        # D for the low request, one arrival per step
    horizon = int(max_seqs + d + ((max_seqs + d) / max_seqs + 2) * (1 + max_tokens)) + 50
    sim = student.run(probe_adversarial, ("Score", *weights), horizon=horizon, max_seqs=max_seqs,
                      max_tokens=max_tokens, prompt_len=prompt_len)
    assert "low" in sim["first"], "starved under score"
    arrivals = sim["arrivals"]
    a = arrivals["low"]
    horizon = math.floor(d)
    ahead = sum(1 for rid, t in arrivals.items() if rid != "low" and t <= a + horizon)
    steps_each = 1 + max_tokens          # one prompt chunk (it fits the budget), then decodes
    bound = a + horizon + math.ceil(ahead / max_seqs) * steps_each
    assert sim["first"]["low"] <= bound, f"admitted at step {sim['first']['low']}, bound {bound}"
    # aging is what admitted it: the same stream starves it under priority for as long
    starved = student.run(probe_adversarial, "priority", horizon=sim["first"]["low"] + 1)
    assert "low" not in starved["first"]


def probe_stream(reqs, num_blocks, block_size, budget, max_seqs, policy) -> dict:
    sim = Sim(num_blocks, block_size, budget, max_seqs, policy)
    pending = [(t, i, plen, out, prio) for i, (plen, out, t, prio) in enumerate(reqs)
               if -(-(plen + out) // block_size) <= num_blocks]   # the engine rejects the rest
    while (pending or sim.sched.has_unfinished()) and sim.step < 3000:
        for item in [p for p in pending if p[0] <= sim.step]:
            pending.remove(item)
            sim.add(f"r{item[1]}", item[2], item[3], item[4])
        sim.run_step()
    return sim.summary() | {"pending": len(pending)}


@settings(max_examples=40, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 8),
                               st.integers(0, 3)), min_size=1, max_size=14),
       num_blocks=st.integers(8, 30), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(4, 48), max_seqs=st.integers(1, 6),
       policy=st.sampled_from(["priority", "score", ("Priority", 1), ("Score", 1.0, 1.0, 5.0, 0.0)]))
def test_random_streams_finish_without_thrash_or_leaks(student, reqs, num_blocks, block_size,
                                                       budget, max_seqs, policy):
    """Every request finishes, the pool ends full, and no pair evicts each other back and forth
    (a candidate never becomes its victim's victim)."""
    sim = judged(student.run(probe_stream, reqs, num_blocks, block_size, budget, max_seqs, policy))
    kept = {f"r{i}": out for i, (plen, out, _, _) in enumerate(reqs)
            if -(-(plen + out) // block_size) <= num_blocks}
    assert sim["pending"] == 0 and sim["done"] == kept, \
        f"every request finishes with max_tokens tokens: {sim['done']} vs {kept}"
    pairs = {(v, c) for _, v, c in sim["evictions"]}
    assert not {(c, v) for v, c in pairs} & pairs, f"ping-pong evictions: {sim['evictions']}"


PREFIX = list(range(20, 32))
PROMPTS = [PREFIX + [40 + i] * (1 + i % 5) for i in range(10)]
PARAMS = [SamplingParams(max_tokens=8, ignore_eos=True),
          SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=5, beam_width=2, ignore_eos=True)]
_MODEL = {}


def probe_engine_tokens(policy_name: str) -> tuple[dict, int, int]:
    """The same requests (greedy, seeded n = 2 samples, beams; shared prefixes), arriving one per
    step, each more urgent than the last, three seats: every request's outputs, the preemptions,
    and the free blocks at the end."""
    from minillm import LLM, load_model
    if "m" not in _MODEL:
        _MODEL["m"] = load_model("tiny-llama", dtype=torch.float32)
    llm = LLM(_MODEL["m"], engine="paged", block_size=4, num_blocks=24, max_num_seqs=3,
              max_num_batched_tokens=16, enable_prefix_caching=True, policy=policy_name,
              attention_backend="torch")
    reqs = [Request(p, PARAMS[i % 3], request_id=f"q{i}", priority=10 - i)
            for i, p in enumerate(PROMPTS)]
    for r in reqs:                  # one arrival per step, each more urgent than the last
        llm.engine.add_request(r)
        llm.engine.step()
    for _ in range(5000):
        if not llm.engine.has_unfinished():
            break
        llm.engine.step()
    return ({r.request_id: [[int(t) for t in s.token_ids] for s in r.outputs] for r in reqs},
            int(llm.engine.num_preemptions), int(llm.engine.block_manager.num_free_blocks))


@pytest.mark.parametrize("policy", ["priority", "score"])
def test_policies_change_the_order_never_the_tokens(student, policy):
    """The policy evicts, and every request's outputs equal FCFS's (run here, by the reference)."""
    base, _, _ = baseline(student, probe_engine_tokens, "fcfs")
    other, preemptions, free = student.run(probe_engine_tokens, policy)
    assert preemptions > 0, "the pool was meant to be tight enough to preempt"
    assert free == 24, "the pool must end full"
    assert other == base, "a policy changes the order of the requests, never their tokens"


def group(max_tokens: int, prompt: int, generated: list[int], finished: list[int] = (),
          priority: int = 0, arrival_index: int = 0, arrival_step: int = 0) -> SequenceGroup:
    """A request with one sequence per entry of ``generated`` (that many tokens after a prompt
    of ``prompt``) and finished samples of ``finished`` tokens."""
    req = Request([3] * prompt, SamplingParams(max_tokens=max_tokens, n=max(1, len(generated))),
                  priority=priority)

    def seq(k: int) -> Sequence:
        return Sequence(req, [3] * prompt + [5] * k, prompt)
    g = SequenceGroup(req, [seq(k) for k in generated], arrival_index, arrival_step)
    g.done_seqs = [seq(k) for k in finished]
    return g


def probe_policy_values() -> dict:
    """``remaining_tokens``, ``Score.score`` and both ``preempts`` on groups built to tell the
    plausible mistakes apart."""
    rem = {"n3": group(20, 7, [3, 9, 5]), "finished": group(20, 7, [4], finished=[15]),
           "fresh": group(12, 30, [0]), "done_all_but_one": group(10, 2, [6], finished=[10, 8])}
    s = Score(wait_weight=2.0, remaining_weight=0.5, priority_weight=100.0, margin=0.0)
    a = group(20, 4, [0], arrival_index=5, arrival_step=1)      # arrived first, indexed later
    b = group(20, 4, [0], arrival_index=1, arrival_step=9)
    short, long = group(20, 4, [16]), group(20, 4, [2])
    same1, same2 = group(20, 4, [3], priority=2), group(20, 4, [3], priority=2)
    return {"remaining": {k: int(remaining_tokens(g)) for k, g in rem.items()},
            "score": [float(s.score(g)) for g in (a, b, short, long)],
            "score_order": [bool(s.key(a) < s.key(b)), bool(s.key(short) < s.key(long))],
            "score_preempts_tie": bool(s.preempts(same1, same2)),
            "priority_preempts": [bool(Priority(0).preempts(same1, same2)),
                                  bool(Priority(1).preempts(group(9, 1, [0], priority=1),
                                                            group(9, 1, [0], priority=2))),
                                  bool(Priority(1).preempts(group(9, 1, [0], priority=0),
                                                            group(9, 1, [0], priority=2)))],
            "priority_reversed": bool(Priority(1).preempts(group(9, 1, [0], priority=2),
                                                           group(9, 1, [0], priority=0)))}


def test_remaining_score_and_strict_preemption(student):
    got = student.run(probe_policy_values)
    assert got["remaining"] == {"n3": 11, "finished": 16, "fresh": 12, "done_all_but_one": 4}, (
        f"remaining_tokens: max_tokens minus the output of the *furthest unfinished* sample (no "
        f"prompt, no finished sample): got {got['remaining']}, want 20-9, 20-4, 12, 10-6")
    assert got["score"] == [2.0 + 10.0, 18.0 + 10.0, 2.0, 9.0], (
        "Score.score = priority_weight * priority + remaining_weight * remaining + wait_weight * "
        f"arrival_step (not arrival_index): got {got['score']}, want [12, 28, 2, 9]")
    assert got["score_order"] == [True, True], \
        "lower score first: the earlier arrival_step, and the shorter remaining, go first"
    assert got["score_preempts_tie"] is False, \
        "Score.preempts: a victim must score MORE than the candidate plus the margin (strict >)"
    assert not (got["priority_reversed"] and not got["priority_preempts"][2]), (
        "Priority.preempts(candidate, victim): the waiting candidate evicts the running victim; "
        "yours lets priority 2 evict 0 and not 0 evict 2 (the arguments swapped?)")
    assert got["priority_preempts"] == [False, False, True], (
        "Priority.preempts: the victim's value must exceed the candidate's by MORE than the "
        f"threshold: gaps 0 (threshold 0), 1, 2 (threshold 1) gave {got['priority_preempts']}")
