"""Checks the graders share with the project's own tests: the books of a block manager.

The books are read into plain data (``book_state``) and judged on that data (``check_books``):
a grader reads them in the student's process and judges them in its own (where the student's
code cannot reach the verdict), and ``tests/`` does both at once on the package's block
manager (``check_block_invariants``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the grader's module may be a student's file: import nothing at run time
    from minillm.core.block_manager import BlockManager
    from minillm.core.sequence import Sequence


def book_state(bm: BlockManager, seqs: list[Sequence]) -> dict:
    """What the books say, as plain data: every block's ref_count and hash, the free queue in
    order, the prefix cache, and each live sequence's table and computed tokens."""
    return {"block_size": int(bm.block_size), "num_free": int(bm.num_free_blocks),
            "ref_counts": [int(b.ref_count) for b in bm.blocks],
            "hashes": [None if b.hash is None else int(b.hash) for b in bm.blocks],
            "free_queue": [int(b) for b in bm.free_queue],
            "cached": {int(h): int(b) for h, b in bm.cached.items()},
            "seqs": [(int(s.seq_id), [int(b) for b in s.block_table], int(s.num_computed_tokens))
                     for s in seqs]}


def check_books(state: dict) -> None:
    """The books of a block manager (``book_state``), given every sequence that holds blocks."""
    held: dict[int, int] = {}
    for _, table, _ in state["seqs"]:
        for b in table:
            held[b] = held.get(b, 0) + 1
    free = set(state["free_queue"])
    for bid, count in enumerate(state["ref_counts"]):
        assert count == held.get(bid, 0), (
            f"block {bid}: ref_count {count}, but {held.get(bid, 0)} "
            "sequence(s) list it in their block table")
        assert (count == 0) == (bid in free), (
            f"block {bid}: ref_count {count} but {'in' if bid in free else 'not in'} the free "
            "queue — a block is free exactly when nobody holds it")
    queue = state["free_queue"]
    assert len(free) == len(queue) == state["num_free"], (
        f"the free queue lists {len(queue)} blocks ({len(free)} different) but num_free_blocks "
        f"is {state['num_free']}: a block is listed once, when it is free")
    for h, bid in state["cached"].items():
        assert state["hashes"][bid] == h, f"the prefix cache lists block {bid} under another hash"
    for seq_id, table, computed in state["seqs"]:
        assert len(table) * state["block_size"] >= computed, \
            f"sequence {seq_id} has computed tokens without slots for them"


def check_block_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    """The books of a block manager, given every sequence that holds blocks."""
    check_books(book_state(bm, seqs))
