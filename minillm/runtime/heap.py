"""Memory the engines freed goes back to the operating system (Linux with glibc).

An engine's KV pool and its weight copies (oneDNN's packed weights, the fused projections) are
freed when its last reference goes (no engine sits in a reference cycle). But the runner asks
glibc to keep freed memory for the next step (core/runner.py's ``keep_freed_memory``: blocks
under 32 MiB come from the heap, and up to 1 GiB of free heap is kept, so a step reuses its
pages instead of faulting fresh ones), and a freed engine's blocks stay resident with the
rest; the next engine's blocks do not fit its holes well, so a process that builds engine after
engine grows: notebook 06 builds fifteen, and its kernel's quick run reached 9.3 GB, enough
for the OOM killer beside two test workers on a 24 GB machine (docs/TESTING.md).
``malloc_trim(0)`` hands the heap's free pages back. ``create_engine`` calls it before it builds
(not when an engine is freed: a finalizer runs before the engine's attributes are released):
measured, 60-70 ms after a freed SmolLM2 engine (1.7 GB given back), ~5 ms after the tiny
model's, 0.5 ms with nothing to give back.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import sys
import weakref

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14         # linux/mman.h
# (start, end) of every live buffer ``gather`` made: what ``gathered`` asks. A buffer's entry goes
# when its storage is freed (torch keeps one Python object per storage while any tensor uses it, so
# a finalizer on it runs exactly then); else a later tensor at a freed buffer's address would be
# taken as gathered and never moved.
_gathered: dict[int, tuple[int, int]] = {}
_keys = itertools.count()


@functools.cache
def _libc():
    """The process's C library if it is glibc (it has ``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim() -> bool:
    """Give the heap's free pages back to the OS; False where there is no glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """(``nbytes`` uint8 of fresh memory starting on a 2 MiB boundary, whether the kernel was
    asked to back it with 2 MiB pages). A decode step at one row streams every weight once: with
    4 KiB pages the CPU's prefetchers stop at each page's end and the TLB misses every 4 KiB, so a
    step's 134 MB of int8 weights read at 13.6 GB/s; in one buffer on huge pages at 16-21 GB/s
    (docs/rungs/14_compiled.md). Linux only (``madvise(MADV_HUGEPAGE)``, honoured where
    /sys/kernel/mm/transparent_hugepage/enabled is ``madvise`` or ``always``); elsewhere plain."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[start:start + nbytes]
    libc = _libc()
    # advised before the first touch, so that the page faults allocate huge pages
    asked = libc is not None and nbytes >= HUGE_PAGE and libc.madvise(
        ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes - nbytes % HUGE_PAGE),
        _MADV_HUGEPAGE) == 0
    return buf, asked


def gather(tensors: list[torch.Tensor], align: int = 64) -> list[torch.Tensor]:
    """Copies of ``tensors`` (contiguous, CPU) side by side in one ``huge_page_buffer``, each
    starting on an ``align``-byte boundary; the originals are freed with their last reference."""
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.numel() * t.element_size() // align) * align
    buf, _ = huge_page_buffer(max(size, 1))
    key = next(_keys)
    _gathered[key] = (buf.data_ptr(), buf.data_ptr() + size)
    weakref.finalize(buf.untyped_storage(), _gathered.pop, key, None)
    out = []
    for t, off in zip(tensors, offsets):
        view = buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append(view.copy_(t))
    return out


def gathered(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a buffer ``gather`` made (so moving it again would buy nothing)."""
    p = t.data_ptr()
    return any(a <= p < b for a, b in _gathered.values())


__all__ = ["HUGE_PAGE", "gather", "gathered", "huge_page_buffer", "trim"]
