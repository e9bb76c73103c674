"""The one run loop (minillm/runtime/driver.py): admission, step numbers, the clocks, and the
clean-up when a run fails. The engine counts its own steps (``Engine.step`` is a template)."""
from __future__ import annotations

import queue
from collections import Counter

import pytest

from minillm import LLM, SamplingParams
from minillm.runtime.driver import (Driver, InboxArrivals, ScheduledArrivals, StepClock,
                                    WallClock)
from minillm.request import FinishReason

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def prompt(n: int, start: int = 5) -> list[int]:
    return [start + i % 50 for i in range(n)]


def pool_full(engine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished()


def step_run(llm: LLM, steps: list[int], idle: str):
    reqs = llm.make_requests([prompt(7), prompt(9, 20), prompt(4, 40)], PARAMS)
    driver = Driver(llm.engine, StepClock(idle), ScheduledArrivals(list(zip(steps, reqs))),
                    keep_outputs=True)
    return reqs, driver.run()


@pytest.mark.parametrize("idle", ["jump", "tick"])
def test_a_step_clock_adds_requests_at_deterministic_steps(tiny, idle):
    """Arrivals at steps 0 and 2, then one at 50, long after the first two ended (6 tokens
    each): "tick" counts the empty steps in between, "jump" skips them."""
    llm = LLM(tiny, engine="paged", block_size=4)
    reqs, result = step_run(llm, [0, 2, 50], idle)
    added = [r.added_step for r in reqs]
    assert added[:2] == [0, 2]
    assert [s.step for s in result.steps] == list(range(1, len(result.steps) + 1))
    if idle == "tick":
        assert added[2] == 50
        assert [s.batch_size for s in result.steps[added[1] + 6:50]] == [0] * (50 - added[1] - 6)
    else:
        assert added[2] == added[1] + 6 and all(s.batch_size > 0 for s in result.steps)
    again_reqs, again = step_run(LLM(tiny, engine="paged", block_size=4), [0, 2, 50], idle)
    assert [r.added_step for r in again_reqs] == added
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in result.outputs]
    assert llm.engine.total_steps == sum(s.batch_size > 0 for s in result.steps)
    assert pool_full(llm.engine)


def test_the_wall_and_step_clocks_give_the_same_tokens(tiny):
    llm = LLM(tiny, engine="paged", block_size=4)
    wall = llm.run(llm.make_requests([prompt(7), prompt(9, 20), prompt(4, 40)], PARAMS))
    _, stepped = step_run(LLM(tiny, engine="paged", block_size=4), [0, 3, 5], "admit")
    assert [o.token_ids for o in stepped.outputs] == [o.token_ids for o in wall.outputs]
    assert all(o.finish_reason == FinishReason.LENGTH for o in stepped.outputs)


def test_a_request_rejected_on_admission_gets_one_error_output(tiny):
    llm = LLM(tiny, engine="paged", block_size=4)
    reqs = llm.make_requests([prompt(5), prompt(6, 30)], PARAMS)
    reqs[1].prompt_token_ids = []
    seen: Counter = Counter()
    result = llm.run(reqs, on_output=lambda o: seen.update([o.request_id]))
    assert seen == Counter({reqs[0].request_id: 1, reqs[1].request_id: 1})
    bad = result.outputs[1]
    assert bad.finish_reason == FinishReason.ERROR and "empty prompt" in bad.error
    assert result.metrics.num_errors == 1 and result.outputs[0].finish_reason == FinishReason.LENGTH
    assert pool_full(llm.engine)
    rejected = []                                   # with on_reject: no output, the caller's call
    driver = Driver(llm.engine, StepClock(), ScheduledArrivals([(0, r) for r in
                    llm.make_requests([[]], PARAMS)]),
                    on_reject=lambda req, e: rejected.append(str(e)), keep_outputs=True)
    assert driver.run().outputs == [] and len(rejected) == 1 and "empty prompt" in rejected[0]


def test_an_exception_in_on_output_aborts_every_request_and_frees_the_pool(tiny):
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=64)
    reqs = llm.make_requests([prompt(5), prompt(6, 30), prompt(40, 10)],
                             [SamplingParams(max_tokens=2), SamplingParams(max_tokens=40,
                                                                          ignore_eos=True),
                              SamplingParams(max_tokens=4)])
    reqs[2].arrival_offset_s = 3600.0               # still to arrive when the run fails

    def boom(out):
        raise ValueError(f"consumer bug at {out.request_id}")

    with pytest.raises(ValueError, match="consumer bug"):
        llm.run(reqs, on_output=boom)
    assert reqs[0].finish_reason == FinishReason.LENGTH    # finished: its output raised
    assert [r.finish_reason for r in reqs[1:]] == [FinishReason.ABORT] * 2
    assert pool_full(llm.engine)
    again = llm.run(llm.make_requests([prompt(6, 30)], PARAMS))     # serves on as before
    ref = LLM(tiny, engine="paged", block_size=4)
    assert again.outputs[0].token_ids == ref.run(ref.make_requests([prompt(6, 30)],
                                                                   PARAMS)).outputs[0].token_ids
    assert again.steps[0].step == 1


def test_max_steps_ends_a_run_that_never_ends_and_cleans_up(tiny):
    llm = LLM(tiny, engine="paged", block_size=4)
    reqs = llm.make_requests([prompt(5)], SamplingParams(max_tokens=50, ignore_eos=True))
    driver = Driver(llm.engine, StepClock(), ScheduledArrivals([(0, reqs[0])]), max_steps=3)
    with pytest.raises(RuntimeError, match="not done after 3 steps"):
        driver.run()
    assert reqs[0].finish_reason == FinishReason.ABORT and pool_full(llm.engine)
    with pytest.raises(ValueError, match="idle must be"):
        StepClock("sleep")


def test_the_engine_counts_its_own_steps(tiny):
    llm = LLM(tiny, engine="paged", block_size=4)
    engine = llm.engine
    engine.add_request(llm.make_requests([prompt(5)], PARAMS)[0])
    engine.step()
    engine.idle_step()                              # a step clock's empty step: numbered only
    assert (engine.step_count, engine.total_steps) == (2, 1)
    engine.begin_run()
    assert (engine.step_count, engine.total_steps) == (0, 1)
    engine.reset()


def test_inbox_ops_run_in_order_between_adds(tiny):
    """An abort sent right after its add finds the request in the engine (a client that went
    away at once): it ends with ABORT, once, and the pool is full again."""
    llm = LLM(tiny, engine="paged", block_size=4)
    req = llm.make_requests([prompt(5)], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    stop, calls = [], []

    def apply(op, arg):
        calls.append(op)
        if op == "abort":
            llm.engine.abort(arg)
        elif op == "call":
            stop.append(arg)

    inbox: queue.Queue = queue.Queue()
    for item in [("add", (0.0, req)), ("abort", req.request_id), ("call", "stop")]:
        inbox.put(item)
    seen: Counter = Counter()
    clock = WallClock()
    Driver(llm.engine, clock, InboxArrivals(inbox, apply),
           on_output=lambda o: seen.update([o.finish_reason])).run(until=lambda: bool(stop))
    assert calls == ["abort", "call"] and seen == Counter({FinishReason.ABORT: 1})
    assert req.arrival_time == clock.t0 and req.added_step == 0
    assert pool_full(llm.engine)
