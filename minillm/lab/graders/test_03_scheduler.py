"""Exercise 03-scheduler — ``Scheduler._schedule_running``, ``_schedule_waiting`` and ``preempt``.

Random workloads (hypothesis) through the student's scheduler and the real block manager, with a
model that computes nothing: every step stays within the token budget and ``max_num_seqs``, every
scheduled token has a slot, everything finishes and the pool ends full. Then ``preempt`` by its
contract, and the paged engine with a pool small enough to preempt must give Hugging Face's tokens.

Every call of your functions happens in your process (``probe_*``, the ``student`` fixture): the
probes send back what was scheduled, the queues and the books, and the tests judge that here.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.core.block_manager import BlockManager
from minillm.core.sampler import SamplerOutput
from minillm.core.runner import reaching_end, step_order
from minillm.core.scheduler import Scheduler, SchedulerOutput
from minillm.lab.checks import book_state, check_books
from minillm.lab.reference import (assert_greedy_match, hf_greedy, judge_pressure, pressure_runs,
                                   random_prompts, tiny_model)
from minillm.request import Request

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
MAX_STEPS = 5000     # a run that has not ended by then livelocks
# A correct scheduler schedules a token every step while a request waits (every admitted request
# fits the pool); one that schedules nothing this many steps in a row is stuck, and saying so
# at once spares a stuck run (and each example hypothesis shrinks) its 5,000 steps.
MAX_IDLE_STEPS = 20


def fake_step(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    """What the engine does after scheduling, with a model that samples token 1 every time."""
    order = step_order(out.scheduled)
    reached = [order[k][0] for k in reaching_end(order)]
    sched.update_after_forward(out)
    rows = sched.rows_to_sample(reached)
    return sched.update_from_output(SamplerOutput([(s, 1) for _, s in rows], []))


def probe_random_run(reqs: list, num_blocks: int, block_size: int, budget: int, max_seqs: int,
                     prefix: bool, policy: str) -> dict:
    """A workload through the student's scheduler: per step, the tokens scheduled, how many ran,
    each scheduled sequence's (slots, computed tokens, new tokens) and the books; at the end, how
    many tokens each admitted request got, and whether it ended within ``MAX_STEPS``."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    from minillm.engines.r8_policies.policy import get_policy
    sched = Scheduler(bm, budget, max_seqs, get_policy(policy))
    pending, admitted = [], []
    for i, (plen, out_len, arrive, prio) in enumerate(reqs):
        if -(-(plen + out_len) // block_size) > num_blocks:
            continue   # the engine rejects these up front
        req = Request([i % 5] * plen, SamplingParams(max_tokens=out_len), priority=prio,
                      request_id=f"r{i}")
        admitted.append(req)
        pending.append((arrive, req))
    steps, done, step, idle = [], [], 0, 0
    while (pending or sched.has_unfinished()) and step < MAX_STEPS and idle <= MAX_IDLE_STEPS:
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            sched.add(item[1])
        out = sched.schedule()
        idle = idle + 1 if out.num_tokens == 0 and not pending else 0
        slots = [(len(seq.block_table) * block_size, int(seq.num_computed_tokens), int(n))
                 for seq, n in out.scheduled]
        done += fake_step(sched, out)
        steps.append((int(out.num_tokens), len(sched.running), slots,
                      book_state(bm, sched.live_seqs())))
        step += 1
    return {"steps": steps, "ended": not (pending or sched.has_unfinished()),
            "stalled": idle > MAX_IDLE_STEPS,
            "wanted": {r.request_id: int(r.params.max_tokens) for r in admitted},
            "got": [(r.request_id, len(r.output_token_ids)) for r in done],
            "free": int(bm.num_free_blocks)}


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 6),
                               st.integers(0, 3)), min_size=1, max_size=14),
       num_blocks=st.integers(6, 30), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8), prefix=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_runs_finish_within_budget_without_leaks(student, reqs, num_blocks, block_size,
                                                        budget, max_seqs, prefix, policy):
    run = student.run(probe_random_run, reqs, num_blocks, block_size, budget, max_seqs, prefix,
                      policy)
    for step, (tokens, running, slots, books) in enumerate(run["steps"]):
        assert tokens <= budget, f"step {step}: {tokens} tokens, budget {budget}"
        assert running <= max_seqs, f"step {step}: more than max_num_seqs running"
        for have, computed, n in slots:
            assert have >= computed + n, \
                f"step {step}: tokens scheduled without KV slots (append_slots not called?)"
        try:
            check_books(books)
        except AssertionError as e:
            raise AssertionError(f"step {step}: {e}") from None
    assert not run["stalled"], (
        f"step {len(run['steps'])}: nothing scheduled for {MAX_IDLE_STEPS} steps in a row while "
        "requests wait: the scheduler stalls (a preempted request's blocks never freed?)")
    assert run["ended"], f"no end after {MAX_STEPS} steps: the scheduler livelocks"
    assert sorted(r for r, _ in run["got"]) == sorted(run["wanted"]), \
        "every request must finish, once"
    for rid, n in run["got"]:
        assert n == run["wanted"][rid], f"{rid}: {n} tokens, max_tokens {run['wanted'][rid]}"
    assert run["free"] == num_blocks, "the pool must end full (blocks leaked)"


def probe_preempt() -> dict:
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    a = Request(list(range(6)), SamplingParams(max_tokens=20), request_id="a")
    b = Request(list(range(6)), SamplingParams(max_tokens=20), request_id="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    seen = {"admitted": sorted(s.request.request_id for s, _ in out.scheduled)}
    victim = sched.groups["b"]
    sched.preempt(victim, out)
    seen.update(running=[g.request.request_id for g in sched.running],
                waiting=[g.request.request_id for g in sched.waiting],
                victim_tables=[list(s.block_table) for s in victim.seqs],
                free=bm.num_free_blocks,
                scheduled=[s.request.request_id for s, _ in out.scheduled],
                counts=(b.num_preemptions, sched.num_preemptions))
    return seen


def test_preempt_frees_everything_and_requeues_in_front(student):
    s = student.run(probe_preempt)
    assert s["admitted"] == ["a", "b"], \
        "both prompts fit the pool (2 blocks each): both must be admitted"
    assert "b" not in s["running"] and s["waiting"][:1] == ["b"], \
        "a preempted request goes back to the front of the waiting queue"
    assert all(not t for t in s["victim_tables"]) and s["free"] == 2, \
        "a preempted request gives all its blocks back"
    assert "b" not in s["scheduled"], "a preempted request's tokens are no longer scheduled this step"
    assert tuple(s["counts"]) == (1, 1), \
        f"one preemption counted on the request and on the scheduler, got {s['counts']}"


def probe_paged_engine(prompts: list) -> list:
    llm = LLM(tiny_model(), engine="paged", block_size=4, num_blocks=10,
              max_num_batched_tokens=7, max_num_seqs=4, attention_backend="torch")
    outs = llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))
    return [(o.error, [int(t) for t in o.token_ids], int(o.num_preemptions)) for o in outs]


def test_paged_engine_with_this_scheduler_equals_hf(student, tiny):
    """8 requests, a pool of 10 blocks and a budget of 7 tokens per step: chunked prefill,
    preemption and recomputation happen, and the tokens must not change."""
    prompts = random_prompts(8, seed=41, lo=3, hi=16)
    outs = student.run(probe_paged_engine, prompts)
    assert len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} requests"
    for i, (p, (error, tokens, preempted)) in enumerate(zip(prompts, outs)):
        assert error is None, error
        assert_greedy_match(tokens, hf_greedy(tiny, p, 9), label=(
            f"request {i} (preempted {preempted} times; look at preempt: all its blocks "
            "freed, and _schedule_running/_schedule_waiting: it is recomputed from its tokens)"))


def admitted_and_stepped(sched: Scheduler, reqs: list[Request]) -> SchedulerOutput:
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    fake_step(sched, out)
    return out


def probe_requeue_order() -> tuple:
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=2)
    a, b, c = (Request(list(range(6)), SamplingParams(max_tokens=20), request_id=x) for x in "abc")
    out = admitted_and_stepped(sched, [a, b, c])      # a and b run, c waits (two seats)
    before = [g.request.request_id for g in sched.waiting]
    sched.preempt(sched.groups["b"], out)
    return before, [g.request.request_id for g in sched.waiting]


def test_a_preempted_request_goes_back_ahead_of_later_arrivals(student):
    before, after = student.run(probe_requeue_order)
    assert before == ["c"], f"two seats: a and b run, c waits; waiting is {before}"
    assert after == ["b", "c"], (
        "a preempted request goes back in front of the requests that arrived after it (preempt: "
        "its place in the waiting queue is its rank, not the back)")


def probe_memory_preemption() -> list:
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    reqs = [Request(list(range(8)), SamplingParams(max_tokens=6), request_id=x) for x in "abc"]
    admitted_and_stepped(sched, reqs)
    return [g.request.request_id for g in sched.schedule().preempted]


def test_memory_preemption_evicts_the_lowest_ranked_running_request(student):
    """Three requests of 8 tokens fill 6 blocks of 4; each next token needs a new block: the
    newest (lowest-ranked under fcfs) must be the one preempted."""
    assert student.run(probe_memory_preemption) == ["c"], (
        "_schedule_running: when a sequence needs a block and none is free, preempt the "
        "lowest-ranked running request (self._lowest_ranked(exclude)), not the one asking")


def probe_head_of_queue() -> list:
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    admitted_and_stepped(sched, [Request(list(range(20)), SamplingParams(max_tokens=8),
                                         request_id="running")])
    big = Request(list(range(16)), SamplingParams(max_tokens=2), request_id="big")
    small = Request(list(range(3)), SamplingParams(max_tokens=2), request_id="small")
    sched.add(big)
    sched.add(small)
    return sorted({s.request.request_id for s, _ in sched.schedule().scheduled})


def test_nobody_overtakes_the_head_of_the_queue(student):
    """The head of the queue does not fit the pool yet; a smaller request behind it would: it
    must wait too (otherwise a stream of small requests starves a large one)."""
    admitted = student.run(probe_head_of_queue)
    assert admitted == ["running"], (
        f"scheduled {admitted}: _schedule_waiting must stop at a head that does not fit, "
        "not admit the requests behind it")


def probe_pressure() -> tuple:
    return pressure_runs()


def test_samples_and_beams_survive_a_tight_pool(student):
    judge_pressure(student.run(probe_pressure), (
        "Scheduler.preempt and _schedule_running (a preempted n > 1 request or beam search "
        "recomputes its prompt once, then its samples adopt it: _readopt_prompt), and "
        "_schedule_waiting"))
