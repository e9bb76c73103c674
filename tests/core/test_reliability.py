"""Reliability: aborts, memory pressure and a fuzz/soak run — every request answered exactly
once, no KV block lost."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from conftest import drain, random_prompts
from minillm import FinishReason, LLM, Request, RequestError, SamplingParams
from minillm.engines import create_engine


@pytest.mark.parametrize("engine_name", ["dynamic", "paged"])
def test_abort_mid_flight(tiny, engine_name):
    engine = create_engine(engine_name, tiny)
    reqs = [Request(p, SamplingParams(max_tokens=30, ignore_eos=True))
            for p in random_prompts(5, seed=20)]
    for r in reqs:
        engine.add_request(r)
    finals = Counter()
    for _ in range(3):
        for r in engine.step().finished:
            finals[r.request_id] += 1
    free_before = engine.block_manager.num_free_blocks if engine_name == "paged" else None
    assert engine.abort(reqs[1].request_id)
    assert not engine.abort(reqs[1].request_id), "aborting twice is a no-op"
    assert not engine.abort("no-such-request")
    if engine_name == "paged":   # its blocks are back at once, before the next step
        assert engine.block_manager.num_free_blocks > free_before
    drain(engine, finals)
    assert all(finals[r.request_id] == 1 for r in reqs)
    assert reqs[1].finish_reason == FinishReason.ABORT and len(reqs[1].output_token_ids) < 30
    assert all(len(r.output_token_ids) == 30 for i, r in enumerate(reqs) if i != 1)
    if engine_name == "paged":
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_waiting_request(tiny):
    engine = create_engine("paged", tiny, max_num_seqs=1)
    a, b = (Request(p, SamplingParams(max_tokens=5)) for p in random_prompts(2, seed=21))
    engine.add_request(a)
    engine.add_request(b)
    engine.step()
    assert engine.abort(b.request_id)           # never scheduled
    finals = Counter()
    drain(engine, finals)
    assert b.finish_reason == FinishReason.ABORT and b.output_token_ids == []


def test_static_engine_cannot_abort(tiny):
    with pytest.raises(NotImplementedError, match="abort needs 'dynamic' or 'paged'"):
        create_engine("static", tiny).abort("x")


def test_memory_pressure_matches_unconstrained_run(tiny):
    prompts = random_prompts(12, seed=22, lo=20, hi=50)
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    free = LLM(tiny, engine="paged").generate(prompts, params)
    tight = LLM(tiny, engine="paged", num_blocks=10, block_size=8)
    res = tight.run(tight.make_requests(prompts, params))
    assert res.metrics.num_preemptions > 0
    assert [o.token_ids for o in res.outputs] == [o.token_ids for o in free]
    bm = tight.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_fuzz_soak_paged(tiny):
    """Thousands of random operations; afterwards every request has exactly one final answer and
    the pool is entirely free."""
    rng = random.Random(23)
    engine = create_engine("paged", tiny, num_blocks=24, block_size=4, max_num_batched_tokens=32,
                           max_num_seqs=6, enable_prefix_caching=True)
    submitted, finals = [], Counter()
    for _ in range(2500):
        op = rng.random()
        if op < 0.3:
            plen = rng.choice([0, 1, 3, 8, 20, 40, 120])
            prompt = [rng.choice([5, 6, rng.randrange(3, 600)]) for _ in range(plen)]
            kw = dict(max_tokens=rng.randint(1, 12), temperature=rng.choice([0, 0.7, 1.2]),
                      top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.8]), seed=rng.randint(0, 9),
                      n=rng.choice([1, 1, 1, 2, 3]), ignore_eos=rng.random() < 0.5)
            if kw["n"] == 1 and rng.random() < 0.1:
                kw["beam_width"], kw["temperature"] = 2, 0   # beam search is deterministic
            req = Request(prompt, SamplingParams(**kw), priority=rng.randint(0, 2))
            submitted.append(req)
            try:
                engine.validate(req)
                engine.add_request(req)
            except RequestError:
                finals[req.request_id] += 1
        elif op < 0.4 and submitted:
            engine.abort(rng.choice(submitted).request_id)
        elif engine.has_unfinished():
            for r in engine.step().finished:
                finals[r.request_id] += 1
    drain(engine, finals)
    assert len(submitted) > 500
    assert all(finals[r.request_id] == 1 for r in submitted), "a request was lost or answered twice"
    reasons = Counter(r.finish_reason for r in submitted if r.finish_reason)
    assert reasons[FinishReason.ABORT] and reasons[FinishReason.LENGTH]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_scheduler_that_stops_scheduling_is_an_error_not_a_hang(tiny):
    """A livelock (running requests that never get scheduled: a lab solution that forgets
    _readopt_prompt, say) ends with a RuntimeError after MAX_IDLE_STEPS steps in a row; an empty
    engine stepped for ever (a synthetic timeline's ticks) never raises."""
    from minillm.core.idle import MAX_IDLE_STEPS
    from minillm.core.scheduler import SchedulerOutput

    engine = LLM(tiny, engine="paged").engine
    for _ in range(MAX_IDLE_STEPS + 5):
        engine.step()                                   # nothing to do: fine
    engine.add_request(Request([5, 6, 7], SamplingParams(max_tokens=50)))
    engine.step()
    engine.scheduler.schedule = lambda *a, **k: SchedulerOutput([], [], [])
    for _ in range(MAX_IDLE_STEPS - 1):
        engine.step()
    with pytest.raises(RuntimeError, match=f"scheduled nothing for {MAX_IDLE_STEPS} steps"):
        engine.step()
