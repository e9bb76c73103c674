"""Property-based tests of the block manager and the scheduler.

The lab's graders (``minillm/lab/graders``) hold the random-operation invariants; ``tests/lab/test_lab.py``
runs every grader on the package's own code, so students and the engine are held to the same
checks. Only what the exercises do not cover is written here.
"""
from __future__ import annotations

from minillm.core.block_manager import BlockManager
from minillm.core.sequence import Sequence
from minillm.request import Request, SamplingParams


def test_prefix_hits_and_lru():
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
