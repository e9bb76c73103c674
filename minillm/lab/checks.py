"""Checks the graders share with the project's own tests: the books of a block manager.

A grader runs them on a student's block manager; ``tests/`` runs them on the package's own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the grader's module may be a student's file: import nothing at run time
    from minillm.core.block_manager import BlockManager
    from minillm.core.sequence import Sequence


def check_block_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    """The books of a block manager, given every sequence that holds blocks."""
    held: dict[int, int] = {}
    for s in seqs:
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for b in bm.blocks:
        assert b.ref_count == held.get(b.block_id, 0), (
            f"block {b.block_id}: ref_count {b.ref_count}, but {held.get(b.block_id, 0)} "
            "sequence(s) list it in their block table")
        assert (b.ref_count == 0) == (b.block_id in bm.free_queue), (
            f"block {b.block_id}: ref_count {b.ref_count} but "
            f"{'in' if b.block_id in bm.free_queue else 'not in'} the free queue — a block is "
            "free exactly when nobody holds it")
    assert len(set(bm.free_queue)) == len(bm.free_queue) == bm.num_free_blocks
    for h, bid in bm.cached.items():
        assert bm.blocks[bid].hash == h
    for s in seqs:
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens, \
            f"sequence {s.seq_id} has computed tokens without slots for them"
