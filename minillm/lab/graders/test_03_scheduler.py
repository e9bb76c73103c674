"""Exercise 03-scheduler — ``Scheduler._schedule_running``, ``_schedule_waiting`` and ``preempt``.

Random workloads (hypothesis) through the student's scheduler and the real block manager, with a
model that computes nothing: every step stays within the token budget and ``max_num_seqs``, every
scheduled token has a slot, everything finishes and the pool ends full. Then ``preempt`` by its
contract, and the paged engine with a pool small enough to preempt must give Hugging Face's tokens.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.core.block_manager import BlockManager
from minillm.core.runner import reaching_end, step_order
from minillm.core.scheduler import Scheduler, SchedulerOutput
from minillm.lab.checks import check_block_invariants
from minillm.lab.reference import (assert_greedy_match, assert_samples_and_beams_survive_pressure,
                                   hf_greedy, random_prompts)
from minillm.request import Request


def fake_step(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    """What the engine does after scheduling, with a model that samples token 1 every time."""
    order = step_order(out.scheduled)
    reached = [order[k][0] for k in reaching_end(order)]
    sched.commit_computed(out)
    return sched.postprocess([(s, 1) for _, s in sched.rows_to_sample(reached)], [])


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 6),
                               st.integers(0, 3)), min_size=1, max_size=14),
       num_blocks=st.integers(6, 30), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8), prefix=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_runs_finish_within_budget_without_leaks(reqs, num_blocks, block_size, budget,
                                                        max_seqs, prefix, policy):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(bm, budget, max_seqs, policy)
    pending, admitted = [], []
    for i, (plen, out_len, arrive, prio) in enumerate(reqs):
        if -(-(plen + out_len) // block_size) > num_blocks:
            continue   # the engine rejects these up front
        req = Request([i % 5] * plen, SamplingParams(max_tokens=out_len), priority=prio)
        admitted.append(req)
        pending.append((arrive, req))
    done, step = [], 0
    while pending or sched.has_unfinished():
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            sched.add(item[1])
        out = sched.schedule()
        assert out.num_tokens <= budget, f"step {step}: {out.num_tokens} tokens, budget {budget}"
        assert len(sched.running) <= max_seqs, f"step {step}: more than max_num_seqs running"
        for seq, n in out.scheduled:
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n, \
                f"step {step}: tokens scheduled without KV slots (append_slots not called?)"
        done += fake_step(sched, out)
        check_block_invariants(bm, sched.live_seqs())
        step += 1
        assert step < 5000, "no progress after 5000 steps: the scheduler livelocks"
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in admitted), \
        "every request must finish"
    for r in done:
        assert len(r.output_token_ids) == r.params.max_tokens
    assert bm.num_free_blocks == num_blocks, "the pool must end full (blocks leaked)"


def test_preempt_frees_everything_and_requeues_in_front():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    a = Request(list(range(6)), SamplingParams(max_tokens=20), request_id="a")
    b = Request(list(range(6)), SamplingParams(max_tokens=20), request_id="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert {s.request.request_id for s, _ in out.scheduled} == {"a", "b"}, \
        "both prompts fit the pool (2 blocks each): both must be admitted"
    victim = sched.groups["b"]
    sched.preempt(victim, out)
    assert victim not in sched.running and sched.waiting[0] is victim, \
        "a preempted request goes back to the front of the waiting queue"
    assert all(not s.block_table for s in victim.seqs) and bm.num_free_blocks == 2, \
        "a preempted request gives all its blocks back"
    assert all(s.request is not b for s, _ in out.scheduled), \
        "a preempted request's tokens are no longer scheduled this step"
    assert b.num_preemptions == 1 and sched.num_preemptions == 1


def test_paged_engine_with_this_scheduler_equals_hf(tiny):
    """8 requests, a pool of 10 blocks and a budget of 7 tokens per step: chunked prefill,
    preemption and recomputation happen, and the tokens must not change."""
    prompts = random_prompts(8, seed=41, lo=3, hi=16)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=10, max_num_batched_tokens=7,
              max_num_seqs=4, attention_backend="torch")
    outs = llm.generate(prompts, params)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.error is None, o.error
        assert_greedy_match(o.token_ids, hf_greedy(tiny, p, 9), label=(
            f"request {i} (preempted {o.num_preemptions} times; look at preempt: all its blocks "
            "freed, and _schedule_running/_schedule_waiting: it is recomputed from its tokens)"))


def admitted_and_stepped(sched: Scheduler, reqs: list[Request]) -> SchedulerOutput:
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    fake_step(sched, out)
    return out


def test_a_preempted_request_goes_back_ahead_of_later_arrivals():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=2)
    a, b, c = (Request(list(range(6)), SamplingParams(max_tokens=20), request_id=x) for x in "abc")
    out = admitted_and_stepped(sched, [a, b, c])      # a and b run, c waits (two seats)
    assert [g.request.request_id for g in sched.waiting] == ["c"]
    sched.preempt(sched.groups["b"], out)
    assert [g.request.request_id for g in sched.waiting] == ["b", "c"], (
        "a preempted request goes back in front of the requests that arrived after it (preempt: "
        "its place in the waiting queue is its rank, not the back)")


def test_memory_preemption_evicts_the_lowest_ranked_running_request():
    """Three requests of 8 tokens fill 6 blocks of 4; each next token needs a new block: the
    newest (lowest-ranked under fcfs) must be the one preempted."""
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    reqs = [Request(list(range(8)), SamplingParams(max_tokens=6), request_id=x) for x in "abc"]
    admitted_and_stepped(sched, reqs)
    out = sched.schedule()
    assert [g.request.request_id for g in out.preempted] == ["c"], (
        "_schedule_running: when a sequence needs a block and none is free, preempt the "
        "lowest-ranked running request (self._lowest_ranked(exclude)), not the one asking")


def test_nobody_overtakes_the_head_of_the_queue():
    """The head of the queue does not fit the pool yet; a smaller request behind it would: it
    must wait too (otherwise a stream of small requests starves a large one)."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    admitted_and_stepped(sched, [Request(list(range(20)), SamplingParams(max_tokens=8),
                                         request_id="running")])
    big = Request(list(range(16)), SamplingParams(max_tokens=2), request_id="big")
    small = Request(list(range(3)), SamplingParams(max_tokens=2), request_id="small")
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    admitted = {s.request.request_id for s, _ in out.scheduled}
    assert admitted == {"running"}, (
        f"scheduled {sorted(admitted)}: _schedule_waiting must stop at a head that does not fit, "
        "not admit the requests behind it")


def test_samples_and_beams_survive_a_tight_pool():
    assert_samples_and_beams_survive_pressure(
        "Scheduler.preempt and _schedule_running (a preempted n > 1 request or beam search "
        "recomputes its prompt once, then its samples adopt it: _readopt_prompt), and "
        "_schedule_waiting")
