"""KV allocators: who holds which slots of the KV memory, behind one small interface.

The scheduler (``engines/s3_paged/scheduler.py``) never looks inside memory. Each step it asks
its allocator whether a sequence's next tokens fit (``can_append``), reserves their slots
(``append_slots``), and gives them back when the sequence finishes or is preempted (``free``);
``fork`` and ``share_prompt`` start a sequence from another one's tokens (n > 1 samples, beams).
Three allocators implement it, so one scheduler drives all three policies and the fragmentation
visualizer (notebook 05) compares them on equal terms:

* ``paged`` — ``BlockManager`` (step 3): fixed-size blocks taken one at a time, shared by
  reference count, copied on write, cached by prefix;
* ``max-length`` — ``ContiguousAllocator``: one contiguous region per sequence, as long as the
  longest request could ever be, reserved when the request is admitted;
* ``exact`` — ``ContiguousAllocator``: a region of exactly prompt + max_tokens, placed first-fit.

``counts`` and ``snapshot`` report the memory by kind (``minillm.memory``) for every one of them.
"""
from __future__ import annotations

from typing import Protocol

from ..engines.s3_paged.block_manager import BlockManager, NoFreeBlocksError
from ..engines.s3_paged.sequence import Sequence
from ..memory import KVCounts, MemorySnapshot
from ..request import Request
from .contiguous import ContiguousAllocator

ALLOCATORS = ("max-length", "exact", "paged")


class KVAllocator(Protocol):
    """What the scheduler needs from KV memory. A sequence holds memory iff its ``block_table``
    is non-empty (block ids when paged; the region's start address when contiguous)."""

    prefix_hits: int                 # prompt tokens served from a prefix cache so far

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool: ...
    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]: ...
    def free(self, seq: Sequence) -> None: ...
    def fork(self, parent: Sequence) -> Sequence: ...
    def share_prompt(self, src: Sequence, dst: Sequence) -> None: ...
    def allocate_cached_prefix(self, seq: Sequence) -> int: ...
    def cache_full_blocks(self, seq: Sequence) -> None: ...
    def capacity_error(self, req: Request, longest: int) -> str | None: ...
    def release_all(self) -> None: ...
    def counts(self, seqs: list[Sequence], bytes_per_slot: int = 1,
               head: Request | None = None) -> KVCounts: ...
    def snapshot(self, seqs: list[Sequence], engine: str, step: int, bytes_per_slot: int,
                 head: Request | None = None) -> MemorySnapshot: ...


def make_allocator(name: str, num_slots: int, block_size: int = 16, max_len: int | None = None,
                   enable_prefix_caching: bool = False, wrap: int = 64,
                   max_model_len: int = 1 << 62) -> KVAllocator:
    """An allocator of ``num_slots`` token slots in all (``paged``: ``num_slots // block_size``
    blocks; ``max-length`` reserves ``max_len`` slots per sequence; ``wrap``: slots per row of a
    contiguous address space's picture)."""
    if name == "paged":
        return BlockManager(num_slots // block_size, block_size, enable_prefix_caching)
    if name in ("max-length", "exact"):
        return ContiguousAllocator(num_slots, name, max_len, wrap, max_model_len)
    raise ValueError(f"unknown allocator {name!r}: choose one of {', '.join(ALLOCATORS)}")


__all__ = ["ALLOCATORS", "BlockManager", "ContiguousAllocator", "KVAllocator", "NoFreeBlocksError",
           "make_allocator"]
