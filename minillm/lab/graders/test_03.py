"""Exercise 03 — the block manager: ``blocks_needed``, ``_needs_cow``, ``append_slots``, ``fork``,
``free`` and ``_release`` in ``block_manager.py``.

Random sequences of allocations, appends, forks and frees (hypothesis) must keep the books exact
after every operation; copy-on-write must protect every sharer; and the paged engine built on the
student's block manager must produce Hugging Face's tokens, with a pool small enough to preempt.

Every call of your functions happens in your process (``probe_*``, the ``student`` fixture): the
probes send back what the block manager's books say (``checks.book_state``) and the tests judge
that here, with the package's own engine and Hugging Face as the reference.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.core.block_manager import BlockManager
from minillm.core.sequence import Sequence
from minillm.lab.checks import book_state, check_books
from minillm.lab.reference import (assert_greedy_match, hf_greedy, judge_pressure, pressure_runs,
                                   random_prompts, tiny_model)
from minillm.request import Request

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "grow"]),
                         st.integers(0, 10_000), st.integers(1, 40)), max_size=80)


def probe_random_operations(ops: list, num_blocks: int, block_size: int, prefix: bool) -> list:
    """Run ``ops`` on the student's block manager; after each operation, what it did (the blocks
    ``blocks_needed`` announced and ``append_slots`` took, the copies, a freed table) and the
    books (``book_state``). The last entry is the books once every sequence is freed."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    req = Request([1], SamplingParams())
    seqs: list[Sequence] = []
    trace = []
    for op, pick, n in ops:
        did: dict = {"op": op}
        if op == "new":
            # a small vocabulary, so prompts repeat and prefix-cache hits happen
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
            if op in ("append", "grow"):
                k = 1 if op == "append" else n
                seq.token_ids += [pick % 3] * k
                if bm.can_append(seq, k):
                    need, before = bm.blocks_needed(seq, k), bm.num_free_blocks
                    copies = bm.append_slots(seq, k)
                    did.update(need=int(need), took=int(before - bm.num_free_blocks),
                               copies=[(int(a), int(b), int(bm.blocks[b].ref_count))
                                       for a, b in copies])
                    seq.num_computed_tokens = seq.num_tokens
                    bm.cache_full_blocks(seq)
                else:
                    del seq.token_ids[-k:]
            elif op == "fork":
                seqs.append(bm.fork(seq))
            elif op == "free":
                bm.free(seq)
                did["table_after_free"] = [int(b) for b in seq.block_table]
                seqs.remove(seq)
        trace.append((did, book_state(bm, seqs)))
    for seq in seqs:
        bm.free(seq)
    trace.append(({"op": "free all"}, book_state(bm, [])))
    return trace


def judge_operations(trace: list, num_blocks: int) -> None:
    for i, (did, books) in enumerate(trace):
        where = f"after operation {i} ({did['op']})"
        try:       # the books first: a block freed while shared shows here by name, whichever
            check_books(books)          # operation hypothesis happens to find it with
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
        if "need" in did:
            assert did["took"] == did["need"], (
                f"{where}: blocks_needed said {did['need']}, append_slots took {did['took']}")
            for src, dst, count in did["copies"]:
                assert src != dst and count == 1, (
                    f"{where}: a copy-on-write pair ({src}, {dst}) must name a new block held "
                    f"by the writer alone (its ref_count is {count})")
        assert did.get("table_after_free", []) == [], f"{where}: a freed sequence holds no blocks"
    assert trace[-1][1]["num_free"] == num_blocks, "every block returns to the pool"


@settings(max_examples=120, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]),
       prefix=st.booleans())
def test_random_operations_keep_the_books(student, ops, num_blocks, block_size, prefix):
    trace = student.run(probe_random_operations, ops, num_blocks, block_size, prefix)
    judge_operations(trace, num_blocks)


def probe_copy_on_write() -> dict:
    """Two sharers of a half-full block; the child writes into it, then each is freed."""
    bm = BlockManager(8, 4)
    req = Request([1], SamplingParams())
    a = Sequence(req, list(range(6)), 6)               # blocks: [0 1 2 3] [4 5 _ _]
    bm.append_slots(a, 6)
    a.num_computed_tokens = 6
    b = bm.fork(a)
    seen = {"a_forked": list(a.block_table), "b_forked": list(b.block_table),
            "counts_forked": [bm.blocks[x].ref_count for x in a.block_table]}
    b.token_ids.append(99)
    seen["copies"] = [list(c) for c in bm.append_slots(b, 1)]   # b writes into the shared block
    seen["a"], seen["b"] = list(a.block_table), list(b.block_table)
    seen["counts"] = [bm.blocks[a.block_table[1]].ref_count, bm.blocks[b.block_table[1]].ref_count]
    bm.free(a)                                         # the child keeps what it still shares
    seen["b0_after"] = (bm.blocks[b.block_table[0]].ref_count, b.block_table[0] in bm.free_queue)
    bm.free(b)
    seen["free_at_end"] = bm.num_free_blocks
    return seen


def test_copy_on_write_protects_every_sharer(student):
    s = student.run(probe_copy_on_write)
    assert s["b_forked"] == s["a_forked"], "a fork shares every block of its parent"
    assert s["counts_forked"] == [2, 2], "a fork adds one reference to each shared block"
    assert s["copies"] == [[s["a"][1], s["b"][1]]] and s["a"][1] != s["b"][1], (
        "writing into a block another sequence holds must copy it first: append_slots returns "
        f"[(shared block, new block)], got {s['copies']}")
    assert s["a"][0] == s["b"][0], "the full first block stays shared"
    assert s["counts"] == [1, 1], f"after the copy each holds its own last block: {s['counts']}"
    assert s["b0_after"] == (1, False), \
        "freeing one sharer must not free a block another sequence still holds"
    assert s["free_at_end"] == 8, "every block returns to the pool"


def probe_free_forgets() -> tuple:
    """A sequence with computed tokens (two of them from the prefix cache), then freed."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = Sequence(Request(list(range(9))), list(range(9)), 9)
    bm.append_slots(seq, 9)
    seq.num_computed_tokens, seq.num_cached_tokens = 9, 4
    bm.free(seq)
    return [int(b) for b in seq.block_table], int(seq.num_computed_tokens), \
        int(seq.num_cached_tokens), int(bm.num_free_blocks)


def test_free_forgets_the_computed_tokens(student):
    """A freed sequence (finished, or preempted and recomputed later) holds no blocks and no K/V:
    its computed and cached token counts go back to 0, or the engine skips tokens whose K/V is
    gone and reads past its (new, empty) block table."""
    table, computed, cached, free = student.run(probe_free_forgets)
    assert table == [] and free == 8, f"after free: table {table}, {free} of 8 blocks free"
    assert computed == 0 and cached == 0, (
        f"after free: num_computed_tokens={computed}, num_cached_tokens={cached}; free must set "
        "both to 0 (a preempted sequence is recomputed from its tokens: stale counts make the "
        "engine read K/V that is gone)")


def probe_paged_engine(prompts: list, max_tokens: int) -> tuple:
    llm = LLM(tiny_model(), engine="paged", block_size=4, num_blocks=10,
              max_num_batched_tokens=16, attention_backend="torch")
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    bm = llm.engine.block_manager
    return ([(o.error, [int(t) for t in o.token_ids], int(o.num_preemptions)) for o in outs],
            int(bm.num_free_blocks), int(bm.num_blocks))


def test_paged_engine_on_this_block_manager_equals_hf(student, tiny):
    """A pool of 10 blocks of 4 slots for 6 requests: blocks are shared, freed, reused and the
    scheduler preempts — the tokens must not change."""
    prompts = random_prompts(6, seed=31, lo=3, hi=14)
    outs, free, total = student.run(probe_paged_engine, prompts, 10)
    assert len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} requests"
    for i, (p, (error, tokens, preempted)) in enumerate(zip(prompts, outs)):
        assert error is None, error
        assert_greedy_match(tokens, hf_greedy(tiny, p, 10), label=(
            f"request {i} (preempted {preempted} times; look at append_slots, free and "
            "_release: a recomputed request must find its slots again)"))
    assert free == total, "after the run every block is back in the pool"


def probe_shared_prompt_peaks() -> list:
    llm = LLM(tiny_model(), engine="paged", block_size=4, num_blocks=32, attention_backend="torch")
    peaks: list[int] = []
    llm.generate([list(range(3, 13))], SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=0),
                 on_step=lambda snap, rec: peaks.append(int((snap.ref_counts > 1).sum())))
    return peaks


def test_parallel_samples_share_their_prompt(student):
    """n = 3 samples of one 10-token prompt: the prompt's blocks are shared, not copied."""
    peaks = student.run(probe_shared_prompt_peaks)
    assert peaks and max(peaks) >= 2, \
        "the samples' first prompt blocks should be shared (ref_count > 1)"


def probe_pressure() -> tuple:
    return pressure_runs()


def test_samples_and_beams_survive_a_tight_pool(student):
    judge_pressure(student.run(probe_pressure), (
        "BlockManager.fork (samples share blocks), append_slots and _needs_cow (copy-on-write, "
        "also of a block the prefix cache holds) and free"))


def probe_write_into_cached_block() -> dict:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(10, 18))
    seq = Sequence(Request(tokens), list(tokens), len(tokens))
    bm.append_slots(seq, 8)
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq)                 # both blocks listed under their tokens
    bm.truncate(seq, 6)                       # rejected guesses: positions 6 and 7 go
    seq.token_ids[6:] = [90, 91]
    cached = seq.block_table[1]
    copies = [list(c) for c in bm.append_slots(seq, 2)]
    return {"cached": cached, "copies": copies, "table": list(seq.block_table),
            "books": book_state(bm, [seq])}


def test_writing_into_a_block_the_prefix_cache_lists_copies_it(student):
    """Speculative decoding's rollback (``truncate``) can leave a sequence's last block full and
    listed in the prefix cache under its old tokens; writing new tokens there would change what a
    later prefix hit reads. ``append_slots`` must copy it first, as it copies a shared block."""
    s = student.run(probe_write_into_cached_block)
    assert s["copies"] == [[s["cached"], s["table"][1]]] and s["table"][1] != s["cached"], (
        "append_slots into a block the prefix cache lists must copy it first (_needs_cow: "
        "ref_count > 1 or a hash), returning (source, destination)")
    check_books(s["books"])


def probe_free_order() -> tuple:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(20, 32))
    seq = Sequence(Request(tokens), list(tokens), len(tokens))
    bm.append_slots(seq, 12)
    seq.num_computed_tokens = 12
    bm.cache_full_blocks(seq)
    table = list(seq.block_table)
    bm.free(seq)
    return table, [int(b) for b in bm.free_queue]


def test_free_puts_blocks_at_the_back_of_the_queue_tail_first(student):
    """With prefix caching, a freed block keeps its contents until it is taken again, and blocks
    are taken from the front of the free queue: so ``free`` puts a sequence's blocks at the back,
    its last block first, and its first block (a prompt's prefix, the likeliest to be reused)
    very last."""
    table, order = student.run(probe_free_order)
    assert order[-3:] == table[::-1] and len(order) == 8, (
        f"free queue after free: {order}; the freed blocks {table} must be at its back, last "
        "block first (free: release tail first; _release: a block whose count reaches 0 joins "
        "the back of the queue)")


def probe_blocks_needed_after_fork() -> list:
    bm = BlockManager(8, 4)
    seq = Sequence(Request(list(range(6))), list(range(6)), 6)
    bm.append_slots(seq, 6)
    seq.num_computed_tokens = 6
    child = bm.fork(seq)
    return [int(bm.blocks_needed(child, 1)), int(bm.blocks_needed(seq, 1)),
            int(bm.blocks_needed(child, 2)), int(bm.blocks_needed(child, 3))]


def test_blocks_needed_counts_the_copy_on_write_block(student):
    """A forked sequence whose last block is shared and not full: its next token fits that block,
    but writing it means copying the block first, so it needs one new block (so does the parent:
    the block is shared both ways). ``can_append`` and the scheduler rely on this count."""
    child1, parent1, child2, child3 = student.run(probe_blocks_needed_after_fork)
    assert child1 == 1 and parent1 == 1, (
        "blocks_needed: a token written into a shared block needs one new block for the copy "
        f"(_needs_cow), even when the block has room (child {child1}, parent {parent1})")
    assert (child2, child3) == (1, 2), f"2 and 3 new tokens: {child2} and {child3}, want 1 and 2"
