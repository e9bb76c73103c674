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
import sys


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


__all__ = ["trim"]
