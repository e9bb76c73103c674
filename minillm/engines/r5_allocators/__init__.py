"""Rung 5 — KV allocators compared (notebook 05, the fragmentation visualizer).

The core's scheduler drives any ``KVAllocator`` (``minillm/core/allocator.py``). This rung adds
two contiguous ones beside the core's ``BlockManager``, so one scheduler drives all three
policies and the visualizer compares them on equal terms:

* ``paged`` — ``BlockManager`` (rung 3): fixed-size blocks taken one at a time, shared by
  reference count, copied on write, cached by prefix;
* ``max-length`` — ``ContiguousAllocator``: one contiguous region per sequence, as long as the
  longest request could ever be, reserved when the request is admitted;
* ``exact`` — ``ContiguousAllocator``: a region of exactly prompt + max_tokens, placed first-fit.

``counts`` and ``snapshot`` report the memory by kind (``minillm.memory``) for every one of them.
"""
from __future__ import annotations

from ...core.allocator import KVAllocator
from ...core.block_manager import BlockManager, NoFreeBlocksError
from .contiguous import ContiguousAllocator

ALLOCATORS = ("max-length", "exact", "paged")


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
