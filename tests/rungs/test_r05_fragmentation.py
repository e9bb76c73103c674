"""The KV allocators keep their books straight under the one scheduler, and a trace recorded from
a real PagedEngine run replays through the paged allocator to exactly the engine's own numbers."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_prompts
from minillm import LLM, SamplingParams
from minillm.memory import FREE, RESERVED, TOKEN
from minillm.engines.r5_allocators import ALLOCATORS
from minillm.viz.accounting import SimConfig
from minillm.viz.replay import compare, simulate
from minillm.viz.traces import Trace, record_paged_run, replay_trace, trace_from_run
from minillm.workload import SimRequest, WorkloadSpec


# --- allocator invariants ----------------------------------------------------------------------
def check_result(res, requests):
    cfg = res.config
    if not res.steps:                 # nothing could ever fit
        assert len(res.rejected) == len(requests)
        return
    pool = cfg.num_blocks * cfg.block_size if res.allocator == "paged" else cfg.budget_slots
    assert len(res.snapshots) == len(res.steps)
    for st_, snap in zip(res.steps, res.snapshots):
        kv = st_.kv
        assert 0 <= kv.token <= kv.allocated <= pool
        assert kv.total == pool
        assert 0 <= kv.external <= kv.free
        assert st_.num_running <= cfg.max_num_seqs
        # every number is read back identically from the snapshot the step drew
        assert snap.counts == kv
        if res.allocator == "paged":
            assert kv.reserved == 0 and kv.external == 0
            seqs = len(snap.extra["block_tables"])
            # waste only in each sequence's last block: fewer than block_size slots each
            assert kv.internal <= (cfg.block_size - 1) * seqs
            assert snap.kind.shape == (cfg.num_blocks, cfg.block_size)
        else:
            assert kv.internal == 0 and kv.cached == 0
            owned = int((snap.owner.reshape(-1)[:pool] >= 0).sum())
            assert owned == kv.allocated, "contiguous regions overlap"
            flat = snap.kind.reshape(-1)[:pool]
            assert int(np.isin(flat, (TOKEN, RESERVED)).sum()) == kv.allocated
            assert int((flat == FREE).sum()) == kv.free
            if res.allocator == "max-length":
                assert kv.allocated % (cfg.max_len or max(
                    r.prompt_len + r.max_tokens for r in requests)) == 0
            if st_.num_waiting == 0:
                assert kv.external == 0
            assert st_.num_preemptions == 0, "regions reserved up front never run out"
    # everything admitted finishes and is freed; the pool is empty at the end
    assert res.steps[-1].num_finished + len(res.rejected) == len(requests)
    assert res.steps[-1].kv.allocated == 0
    assert res.steps[-1].num_running == res.steps[-1].num_waiting == 0


workloads = st.builds(
    WorkloadSpec, num_requests=st.integers(1, 24), arrival_rate=st.sampled_from([None, 0.3, 2.0]),
    prompt_len=st.tuples(st.integers(1, 40), st.integers(1, 120)),
    output_len=st.tuples(st.integers(1, 30), st.integers(1, 90)),
    length_dist=st.sampled_from(["uniform", "long-tail", "bimodal"]),
    shared_prefix=st.booleans(), prefix_len=st.integers(1, 40), n=st.integers(1, 3),
    seed=st.integers(0, 1000))
configs = st.builds(
    SimConfig, budget_slots=st.sampled_from([256, 512, 1024, 4096]),
    block_size=st.sampled_from([1, 4, 16, 64]), max_num_batched_tokens=st.sampled_from([16, 128, 512]),
    max_num_seqs=st.sampled_from([2, 8, 64]), max_len=st.sampled_from([None, 200]),
    enable_prefix_caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority", "score"]))


@settings(max_examples=60, deadline=None)
@given(spec=workloads, cfg=configs)
def test_allocators_keep_their_books(spec, cfg):
    requests = spec.make()
    for name, res in compare(requests, cfg).items():
        check_result(res, requests)
        for r in requests:   # a request is rejected only if it could never fit the budget alone
            if r.request_id in res.rejected and name == "exact":
                assert r.n * (r.prompt_len + r.max_tokens) > cfg.budget_slots


def test_the_story_of_notebook_05():
    """At one budget, paging wastes least and runs the most requests at once; contiguous exact
    reservations leave unusable holes; max-length reservations waste most."""
    spec = WorkloadSpec(num_requests=48, arrival_rate=2.0)
    res = compare(spec.make(), SimConfig(max_len=512, enable_prefix_caching=False))
    s = {k: r.summary() for k, r in res.items()}
    assert s["paged"]["waste_pct"] < 15 < s["exact"]["waste_pct"] < s["max-length"]["waste_pct"]
    assert s["paged"]["peak_running"] > s["exact"]["peak_running"] > s["max-length"]["peak_running"]
    assert s["exact"]["external_pct_of_budget"] > 0 == s["paged"]["external_pct_of_budget"]
    assert s["paged"]["steps"] < s["max-length"]["steps"]


def test_prefix_caching_and_parallel_samples_share_blocks():
    spec = WorkloadSpec(num_requests=16, arrival_rate=0.5, shared_prefix=True, prefix_len=64, n=3)
    reqs = spec.make()
    on = simulate(reqs, "paged", SimConfig(enable_prefix_caching=True))
    off = simulate(reqs, "paged", SimConfig(enable_prefix_caching=False))
    assert on.summary()["prefix_hit_tokens"] > 0 == off.summary()["prefix_hit_tokens"]
    assert any((s.ref_counts > 1).any() for s in off.snapshots), "n = 3 samples share no block"
    # one request, three samples: paged stores the prompt once, contiguous once per sample
    one = [SimRequest("r", list(range(100)), [20, 20, 20], 20)]
    paged_peak = max(s.kv.token for s in simulate(one, "paged", SimConfig()).steps)
    exact_peak = max(s.kv.token for s in simulate(one, "exact", SimConfig()).steps)
    assert paged_peak < 100 + 3 * (16 + 20) < 3 * 100 < exact_peak


def test_simulation_is_deterministic():
    spec = WorkloadSpec(num_requests=64, arrival_rate=1.0)
    reqs = spec.make()
    assert [vars(r) for r in reqs] == [vars(r) for r in spec.make()]     # same seed, same workload
    other = WorkloadSpec(num_requests=64, arrival_rate=1.0, seed=1).make()
    assert [vars(r) for r in reqs] != [vars(r) for r in other]           # the seed is used
    a, b = compare(reqs, SimConfig()), compare(spec.make(), SimConfig())
    for name in ALLOCATORS:
        ra, rb = a[name], b[name]
        assert ra.steps, name
        untimed = lambda steps: [{**vars(s), "prefill_ms": 0, "decode_ms": 0} for s in steps]
        assert untimed(ra.steps) == untimed(rb.steps), name
        assert ra.rejected == rb.rejected and ra.summary() == rb.summary(), name
        assert len(ra.snapshots) == len(rb.snapshots) == len(ra.steps), name
        for sa, sb in zip(ra.snapshots, rb.snapshots):
            assert np.array_equal(sa.kind, sb.kind) and np.array_equal(sa.owner, sb.owner), name
            assert sa.owners == sb.owners, name
            assert (sa.ref_counts is None) == (sb.ref_counts is None), name
            assert sa.ref_counts is None or np.array_equal(sa.ref_counts, sb.ref_counts), name


def test_idle_steps_and_rejections():
    reqs = [SimRequest("a", [1] * 10, [3], 3, 0), SimRequest("b", [2] * 10, [2], 2, 20),
            SimRequest("big", [3] * 5000, [1], 1, 0)]
    ticking = simulate(reqs, "paged", SimConfig(budget_slots=256, block_size=16))
    assert ticking.rejected == ["big"]
    assert len(ticking.steps) >= 22 and ticking.steps[10].kv.allocated == 0
    jumping = simulate(reqs, "paged", SimConfig(budget_slots=256, block_size=16, idle_steps=False))
    assert len(jumping.steps) < len(ticking.steps)


# --- trace replay against a real engine --------------------------------------------------------
ENGINE_CASES = {
    "default": ({}, {}),
    "tiny-pool-preemption": ({"num_blocks": 12, "block_size": 8}, {}),
    "chunked-prefill": ({"max_num_batched_tokens": 7}, {}),
    "prefix-caching": ({"enable_prefix_caching": True, "block_size": 4, "max_num_seqs": 2},
                       {"shared": True}),
    "parallel-samples": ({"num_blocks": 40, "block_size": 4}, {"n": 3}),
    "samples-stopping-at-eos": ({"num_blocks": 30, "block_size": 4}, {"n": 2, "eos": True}),
    "priority": ({"policy": "priority", "max_num_seqs": 2, "num_blocks": 16, "block_size": 4}, {}),
    "arrivals-over-time": ({"num_blocks": 20, "block_size": 4}, {"rate": 300.0}),
    "beam-search": ({"num_blocks": 60, "block_size": 4}, {"beam": 3}),
    "beams-preempted-prefix-cached": ({"num_blocks": 24, "block_size": 4, "max_num_batched_tokens": 16,
                                       "enable_prefix_caching": True},
                                      {"beam": 2, "shared": True, "eos": True}),
    "mixed-n-beams-preempted": ({"num_blocks": 30, "block_size": 4}, {"n": 2, "beam_every": 3}),
}


def engine_run(tiny, case: str):
    options, w = ENGINE_CASES[case]
    rng = random.Random(7)
    prompts = random_prompts(10, seed=3)
    if w.get("shared"):
        prefix = prompts[0][:18]
        prompts = [prefix + p for p in prompts]
    n = w.get("n", 1)
    params = [SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=not w.get("eos"), n=n,
                             temperature=0.8 if n > 1 else 0.0, seed=1) for _ in prompts]
    for i in range(len(params)):
        if w.get("beam") or (w.get("beam_every") and i % w["beam_every"] == 0):
            params[i] = SamplingParams(max_tokens=rng.randint(2, 16), beam_width=w.get("beam", 2),
                                       ignore_eos=not w.get("eos"))
    llm = LLM(tiny, engine="paged", **options)
    reqs = llm.make_requests(prompts, params)
    for i, r in enumerate(reqs):
        r.priority = rng.randint(0, 3)
        if w.get("rate"):
            r.arrival_offset_s = i / w["rate"]
    result, trace = record_paged_run(llm, reqs, source=case)
    return llm, reqs, result, trace


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_trace_replay_equals_engine_exactly(tiny, case):
    _, _, result, trace = engine_run(tiny, case)
    replay = replay_trace(trace)
    fields = ("kv", "num_running", "num_waiting", "num_finished", "num_preemptions",
              "prefix_hit_tokens", "num_prefill_tokens", "num_decode_tokens", "batch_size")
    got = [[getattr(s, f) for f in fields] for s in replay.steps]
    want = [[getattr(s, f) for f in fields] for s in result.steps]
    assert got == want
    assert replay.summary()["waste_pct"] == pytest.approx(result.metrics.kv_waste_pct, abs=1e-9)
    assert replay.summary()["peak_running"] == result.metrics.peak_concurrency
    assert replay.summary()["preemptions"] == result.metrics.num_preemptions
    if case in ("tiny-pool-preemption", "beams-preempted-prefix-cached", "mixed-n-beams-preempted"):
        assert result.metrics.num_preemptions > 0
    if case == "arrivals-over-time":
        assert len({r.arrival_step for r in trace.requests}) > 1
    # the same scheduler serves the same requests under the contiguous allocators
    for name in ("max-length", "exact"):
        check_result(replay_trace(trace, name), trace.requests)


def test_trace_round_trips_through_json(tiny, tmp_path):
    _, _, result, trace = engine_run(tiny, "parallel-samples")
    loaded = Trace.load(trace.save(tmp_path / "t.json"))
    assert loaded == trace
    assert [s.kv for s in replay_trace(loaded).steps] == [s.kv for s in result.steps]


def test_the_engine_records_when_requests_arrive(tiny):
    """``Engine.run`` stamps ``added_step`` itself: traces need no wrapper around the engine."""
    llm = LLM(tiny, engine="paged")
    reqs = llm.make_requests(random_prompts(3, seed=5), SamplingParams(max_tokens=3))
    result = llm.run(reqs)
    trace = trace_from_run(result, reqs, llm.engine)          # all at t=0: step 0 for all
    assert {r.arrival_step for r in trace.requests} == {0}
    late = llm.make_requests(random_prompts(2, seed=6), SamplingParams(max_tokens=30,
                                                                       ignore_eos=True))
    late[1].arrival_offset_s = 0.05
    res = llm.run(late)
    assert res.steps[0].step == 1 == result.steps[0].step, "each run counts its steps from 1"
    assert llm.engine.total_steps == len(result.steps) + len(res.steps)
    steps = [r.arrival_step for r in trace_from_run(res, late, llm.engine).requests]
    assert steps[0] == 0 and steps[1] == late[1].added_step
    unrun = llm.make_requests(random_prompts(1, seed=7), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="was not added by Engine.run"):
        trace_from_run(res, unrun, llm.engine)
    with pytest.raises(TypeError):
        trace_from_run(res, late, LLM(tiny, engine="dynamic").engine)


@pytest.mark.parametrize("engine", ["static", "dynamic", "paged"])
def test_every_snapshot_has_one_reading(tiny, engine):
    """A snapshot's kinds say what they mean: the engine's own counts and the snapshot's agree,
    kind by kind, whoever reads them (block tails are internal, never reserved)."""
    seen = []
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    LLM(tiny, engine=engine, **({"block_size": 4} if engine == "paged" else {})).generate(
        random_prompts(5, seed=9), params, on_step=lambda snap, rec: seen.append((snap, rec)))
    assert seen
    for snap, rec in seen:
        c = snap.counts
        assert c == rec.kv
        assert c.internal + c.reserved == c.allocated - c.token
        if engine == "paged":
            assert snap.layout == "blocks" and c.reserved == 0
        else:
            assert snap.layout == "rectangle"
    if engine == "static":
        assert any(s.counts.reserved > 0 for s, _ in seen)


def test_contiguous_allocator_reserves_at_admission_and_copies_on_fork():
    """The interface the scheduler drives, on the contiguous allocator: a request with n = 3
    reserves three regions when admitted; a fork copies the prompt into one of them; the spare
    regions go back when the request's last sequence is freed; a head that fits in the total
    free space but in no hole sees external fragmentation."""
    from minillm.engines.r5_allocators import ContiguousAllocator, make_allocator
    from minillm.core.sequence import Sequence
    from minillm.request import Request

    alloc = make_allocator("exact", 100)
    req = Request(list(range(10)), SamplingParams(max_tokens=10, n=3, temperature=0.5),
                  request_id="r")
    leader = Sequence(req, list(req.prompt_token_ids), req.prompt_len)
    assert alloc.can_append(leader, 10)
    assert alloc.append_slots(leader, 10) == []
    leader.num_computed_tokens = 10
    assert alloc.counts([leader]).allocated == 60            # 3 regions of 10 + 10
    child = alloc.fork(leader)
    assert child.block_table != leader.block_table and alloc.copied_slots == 10
    assert alloc.counts([leader, child]).token == 20          # the prompt, twice
    assert not alloc.can_append(child, 11)                    # never past its region
    big = Request(list(range(30)), SamplingParams(max_tokens=20), request_id="big")
    assert alloc.capacity_error(big, 50) is None
    assert alloc.counts([], head=big).external == 40          # the one 40-slot hole is too small
    alloc.free(leader)                  # the child still runs: the last spare stays reserved
    assert alloc.counts([child]).allocated == 40
    # 60 slots free, in holes of 20 and 40: a 50-slot request fits in neither
    assert alloc.holes() == [(0, 20), (60, 40)]
    assert alloc.counts([child], head=big).external == 60
    alloc.free(child)
    assert alloc.counts([]).allocated == 0 and alloc.holes() == [(0, 100)]
    too_wide = Request([1] * 30, SamplingParams(max_tokens=10, n=3, temperature=0.5))
    assert "3 contiguous region(s) of 40 slots" in alloc.capacity_error(too_wide, 40)
    with pytest.raises(ValueError, match="max_len"):
        ContiguousAllocator(100, "max-length")


def test_a_replaced_allocator_needs_a_runner_for_it(tiny):
    from minillm.engines.r5_allocators import make_allocator
    from minillm.core.engine import PagedEngine
    with pytest.raises(ValueError, match="pass a runner"):
        PagedEngine(tiny, block_manager=make_allocator("exact", 64))


def test_a_request_keeps_its_colour_across_frames_and_panels():
    """Colours follow the request, not its position in a snapshot's owner list."""
    from minillm.memory import MemorySnapshot
    from minillm.viz.plots import memory_image, owner_color

    def snap(owners):
        kind = np.full((len(owners), 2), TOKEN, dtype=np.int8)
        owner = np.repeat(np.arange(len(owners), dtype=np.int32)[:, None], 2, axis=1)
        return MemorySnapshot("x", 1, kind, owner, owners, 1)
    both, alone = memory_image(snap(["3", "5"])), memory_image(snap(["5"]))
    assert np.allclose(both[1, 0], alone[0, 0]) and np.allclose(alone[0, 0], owner_color("5"))
    assert owner_color("req-4") != owner_color("req-5")     # neighbours differ
    assert owner_color("chat-a") == owner_color("chat-a")
