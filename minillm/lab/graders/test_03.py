"""Exercise 03 — the block manager: ``blocks_needed``, ``_needs_cow``, ``append_slots``, ``fork``,
``free`` and ``_release`` in ``block_manager.py``.

Random sequences of allocations, appends, forks and frees (hypothesis) must keep the books exact
after every operation; copy-on-write must protect every sharer; and the paged engine built on the
student's block manager must produce Hugging Face's tokens, with a pool small enough to preempt.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.core.block_manager import BlockManager
from minillm.core.sequence import Sequence
from minillm.lab.checks import check_block_invariants
from minillm.lab.reference import (assert_greedy_match, assert_samples_and_beams_survive_pressure,
                                   hf_greedy, random_prompts)
from minillm.request import Request


ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free", "grow"]),
                         st.integers(0, 10_000), st.integers(1, 40)), max_size=80)


@settings(max_examples=120, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]),
       prefix=st.booleans())
def test_random_operations_keep_the_books(ops, num_blocks, block_size, prefix):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    req = Request([1], SamplingParams())
    seqs: list[Sequence] = []
    for op, pick, n in ops:
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
                    assert before - bm.num_free_blocks == need, (
                        f"blocks_needed said {need}, append_slots took "
                        f"{before - bm.num_free_blocks}")
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
                assert seq.block_table == [], "a freed sequence holds no blocks"
                seqs.remove(seq)
        check_block_invariants(bm, seqs)
    for seq in seqs:
        bm.free(seq)
    check_block_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks, "every block returns to the pool"


def test_copy_on_write_protects_every_sharer():
    bm = BlockManager(8, 4)
    req = Request([1], SamplingParams())
    a = Sequence(req, list(range(6)), 6)               # blocks: [0 1 2 3] [4 5 _ _]
    bm.append_slots(a, 6)
    a.num_computed_tokens = 6
    b = bm.fork(a)
    assert b.block_table == a.block_table, "a fork shares every block of its parent"
    assert all(bm.blocks[x].ref_count == 2 for x in a.block_table), \
        "a fork adds one reference to each shared block"
    b.token_ids.append(99)
    copies = bm.append_slots(b, 1)                     # b writes into the shared half-full block
    assert copies == [(a.block_table[1], b.block_table[1])], (
        "writing into a block another sequence holds must copy it first: append_slots returns "
        f"[(shared block, new block)], got {copies}")
    assert a.block_table[0] == b.block_table[0], "the full first block stays shared"
    assert bm.blocks[a.block_table[1]].ref_count == 1 == bm.blocks[b.block_table[1]].ref_count
    bm.free(a)                                         # the child keeps what it still shares
    assert bm.blocks[b.block_table[0]].ref_count == 1 and b.block_table[0] not in bm.free_queue, \
        "freeing one sharer must not free a block another sequence still holds"
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_paged_engine_on_this_block_manager_equals_hf(tiny):
    """A pool of 10 blocks of 4 slots for 6 requests: blocks are shared, freed, reused and the
    scheduler preempts — the tokens must not change."""
    prompts = random_prompts(6, seed=31, lo=3, hi=14)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=10, max_num_batched_tokens=16,
              attention_backend="torch")
    outs = llm.generate(prompts, params)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.error is None, o.error
        assert_greedy_match(o.token_ids, hf_greedy(tiny, p, 10), label=(
            f"request {i} (preempted {o.num_preemptions} times; look at append_slots, free and "
            "_release: a recomputed request must find its slots again)"))
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "after the run every block is back in the pool"


def test_parallel_samples_share_their_prompt(tiny):
    """n = 3 samples of one 10-token prompt: the prompt's blocks are shared, not copied."""
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=32, attention_backend="torch")
    peaks = []
    llm.generate([list(range(3, 13))], SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=0),
                 on_step=lambda snap, rec: peaks.append(int((snap.ref_counts > 1).sum())))
    assert max(peaks) >= 2, "the samples' first prompt blocks should be shared (ref_count > 1)"


def test_samples_and_beams_survive_a_tight_pool():
    assert_samples_and_beams_survive_pressure(
        "BlockManager.fork (samples share blocks), append_slots and _needs_cow (copy-on-write, "
        "also of a block the prefix cache holds) and free")


def test_writing_into_a_block_the_prefix_cache_lists_copies_it():
    """Speculative decoding's rollback (``truncate``) can leave a sequence's last block full and
    listed in the prefix cache under its old tokens; writing new tokens there would change what a
    later prefix hit reads. ``append_slots`` must copy it first, as it copies a shared block."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(10, 18))
    seq = Sequence(Request(tokens), list(tokens), len(tokens))
    bm.append_slots(seq, 8)
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq)                 # both blocks listed under their tokens
    bm.truncate(seq, 6)                       # rejected guesses: positions 6 and 7 go
    seq.token_ids[6:] = [90, 91]
    cached = seq.block_table[1]
    copies = bm.append_slots(seq, 2)
    assert copies == [(cached, seq.block_table[1])] and seq.block_table[1] != cached, (
        "append_slots into a block the prefix cache lists must copy it first (_needs_cow: "
        "ref_count > 1 or a hash), returning (source, destination)")
    check_block_invariants(bm, [seq])


def test_free_puts_blocks_at_the_back_of_the_queue_tail_first():
    """With prefix caching, a freed block keeps its contents until it is taken again, and blocks
    are taken from the front of the free queue: so ``free`` puts a sequence's blocks at the back,
    its last block first, and its first block (a prompt's prefix, the likeliest to be reused)
    very last."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(20, 32))
    seq = Sequence(Request(tokens), list(tokens), len(tokens))
    bm.append_slots(seq, 12)
    seq.num_computed_tokens = 12
    bm.cache_full_blocks(seq)
    table = list(seq.block_table)
    bm.free(seq)
    order = list(bm.free_queue)
    assert order[-3:] == table[::-1] and len(order) == 8, (
        f"free queue after free: {order}; the freed blocks {table} must be at its back, last "
        "block first (free: release tail first; _release: a block whose count reaches 0 joins "
        "the back of the queue)")


def test_blocks_needed_counts_the_copy_on_write_block():
    """A forked sequence whose last block is shared and not full: its next token fits that block,
    but writing it means copying the block first, so it needs one new block (so does the parent:
    the block is shared both ways). ``can_append`` and the scheduler rely on this count."""
    bm = BlockManager(8, 4)
    seq = Sequence(Request(list(range(6))), list(range(6)), 6)
    bm.append_slots(seq, 6)
    seq.num_computed_tokens = 6
    child = bm.fork(seq)
    assert bm.blocks_needed(child, 1) == 1 and bm.blocks_needed(seq, 1) == 1, (
        "blocks_needed: a token written into a shared block needs one new block for the copy "
        "(_needs_cow), even when the block has room")
    assert bm.blocks_needed(child, 2) == 1 and bm.blocks_needed(child, 3) == 2
