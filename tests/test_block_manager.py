"""Property-based tests: the block manager never loses, double-frees or miscounts a block, and
the scheduler always finishes every request without leaking one."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.engines.s3_paged.block_manager import BlockManager
from minillm.engines.s3_paged.runner import reaching_end, step_order
from minillm.engines.s3_paged.scheduler import Scheduler
from minillm.engines.s3_paged.sequence import Sequence
from minillm.request import Request, SamplingParams


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    held = {}
    for s in seqs:
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for b in bm.blocks:
        assert b.ref_count >= 0
        assert b.ref_count == held.get(b.block_id, 0), f"block {b.block_id} ref count is wrong"
        assert (b.ref_count == 0) == (b.block_id in bm.free_queue)
    counts = bm.counts(seqs)
    used = sum(1 for b in bm.blocks if b.ref_count > 0)
    assert used + bm.num_free_blocks == bm.num_blocks
    assert counts.total == bm.num_blocks * bm.block_size
    assert counts.allocated == used * bm.block_size and 0 <= counts.token <= counts.allocated
    assert len(set(bm.free_queue)) == len(bm.free_queue)
    for h, bid in bm.cached.items():
        assert bm.blocks[bid].hash == h
    for s in seqs:   # every computed token has a slot
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "grow"]),
                         st.integers(0, 10_000), st.integers(1, 40)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]),
       prefix=st.booleans())
def test_block_manager_random_operations(ops, num_blocks, block_size, prefix):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    req = Request([1], SamplingParams())
    seqs: list[Sequence] = []
    for op, pick, n in ops:
        if op == "new":
            # small vocab so prompts repeat and prefix-cache hits happen
            seq = Sequence(req, [(pick + i) % 3 for i in range(n)], n)
            bm.allocate_cached_prefix(seq)
            if bm.can_append(seq, seq.num_uncomputed):
                bm.append_slots(seq, seq.num_uncomputed)
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                seqs.append(seq)
            else:
                bm.free(seq)
        elif seqs:
            seq = seqs[pick % len(seqs)]
            if op == "append" or op == "grow":
                k = 1 if op == "append" else n
                seq.token_ids += [pick % 3] * k
                if bm.can_append(seq, k):
                    need, before = bm.blocks_needed(seq, k), bm.num_free_blocks
                    copies = bm.append_slots(seq, k)
                    assert before - bm.num_free_blocks == need
                    for src, dst in copies:
                        assert src != dst and bm.blocks[dst].ref_count == 1
                    seq.num_computed_tokens = seq.num_tokens
                    bm.cache_full_blocks(seq)
                else:
                    del seq.token_ids[-k:]
            elif op == "fork":
                seqs.append(bm.fork(seq))
            elif op == "free":
                bm.free(seq)
                seqs.remove(seq)
        check_invariants(bm, seqs)
    for seq in seqs:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks


def test_copy_on_write_and_prefix_hits():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    req = Request([1], SamplingParams())
    a = Sequence(req, list(range(6)), 6)
    bm.append_slots(a, 6)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    b = bm.fork(a)
    assert bm.blocks[a.block_table[1]].ref_count == 2
    b.token_ids.append(99)
    copies = bm.append_slots(b, 1)          # b writes into the shared, half-full block
    assert copies == [(a.block_table[1], b.block_table[1])]
    assert a.block_table[0] == b.block_table[0]   # the full first block stays shared
    # a new sequence with the same first 4 tokens reuses the cached full block
    c = Sequence(req, list(range(4)) + [7, 7, 7], 7)
    assert bm.allocate_cached_prefix(c) == 4 and c.block_table == [a.block_table[0]]
    # freed cached blocks are evicted least-recently-freed first
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free_blocks == 8 and bm.cached


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 6),
                               st.integers(0, 3)), min_size=1, max_size=14),
       num_blocks=st.integers(6, 30), block_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 8), prefix=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_scheduler_random_runs_finish_without_leaks(reqs, num_blocks, block_size, budget,
                                                    max_seqs, prefix, policy):
    """Drive the real scheduler and block manager with a fake model (every sequence that reaches
    its end samples token 1): random prompts, output lengths, arrival steps and priorities.
    Everything finishes; the pool ends full."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(bm, budget, max_seqs, policy)
    pending, admitted = [], []
    for i, (plen, out_len, arrive, prio) in enumerate(reqs):
        if -(-(plen + out_len) // block_size) > num_blocks:
            continue   # the engine rejects these up front (tested elsewhere)
        req = Request([i % 5] * plen, SamplingParams(max_tokens=out_len), priority=prio)
        admitted.append(req)
        pending.append((arrive, req))
    done, step = [], 0
    while pending or sched.has_unfinished():
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            sched.add(item[1])
        out = sched.schedule()
        assert out.num_tokens <= budget
        assert len(sched.running) <= max_seqs
        for seq, n in out.scheduled:
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
        reached = [step_order(out.scheduled)[k][0] for k in reaching_end(step_order(out.scheduled))]
        sched.commit_computed(out)
        done += sched.postprocess([(s, 1) for _, s in sched.rows_to_sample(reached)], [])
        check_invariants(bm, sched.live_seqs())
        step += 1
        assert step < 5000, "scheduler livelock"
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in admitted)
    assert not sched.running and not sched.waiting and not sched.groups
    for r in done:
        assert len(r.output_token_ids) == r.params.max_tokens
    assert bm.num_free_blocks == num_blocks
