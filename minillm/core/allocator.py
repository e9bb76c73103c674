"""What the scheduler needs from KV memory: the ``KVAllocator`` interface (notebook 03).

The scheduler (``scheduler.py``) never looks inside memory. Each step it asks its allocator
whether a sequence's next tokens fit (``can_append``), reserves their slots (``append_slots``),
and gives them back when the sequence finishes or is preempted (``free``); ``fork`` and
``share_prompt`` start a sequence from another one's tokens (n > 1 samples, beams). The core's
``BlockManager`` implements it; rung 5 (``minillm/engines/r5_allocators``) adds two contiguous
allocators, so the same scheduler drives all three. ``counts`` and ``snapshot`` report the memory
by kind (``minillm.memory``): an allocator counts and says who holds what, and ``minillm.memory``
draws the picture (``paged_snapshot``, ``contiguous_snapshot``).
"""
from __future__ import annotations

from typing import Protocol

from ..memory import KVCounts, MemorySnapshot
from ..request import Request
from .sequence import Sequence


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
