"""The compiled kernels a jailed student's process imports instead of compiling its own.

A paged engine on the CPU loads C++ extensions (the fused layer ops, the paged-attention kernel),
compiled once per toolchain into torch's extensions folder (``layers/attention/cpp_build.py``).
In the jail (``jail.py``) the student's process has a home of its own, a fresh ``/tmp``: it
compiled them again in every grading whose student builds an engine, ~45 s of a compiler at one
thread while the student's first call waited (``ps`` during ``make test``, 2026-12-07). So the
grading process makes sure they are built (it loads them, as its own engines would), and the
jail binds that folder read-only at ``INSIDE`` for the child to import from. A kernel missing
there (the one-row gemv of rung 14, before anything built it) the child cannot build: it falls
back as a machine without a compiler does, with the warning that says so.

Outside a jail the child keeps compiling in its own folder: a folder it could write, the
teacher's next grading would load kernels from.
"""
from __future__ import annotations

import functools
import os

INSIDE = "/extensions"


@functools.cache
def built_extensions() -> str | None:
    """torch's extensions folder of this process, once the kernels every CPU engine loads are
    built in it; None where none is (``MINILLM_CPP=0``, no compiler: the child then falls back
    as this process did)."""
    import torch

    from ..layers.attention import cpp
    from ..layers.attention.cpp_build import build_root
    from ..layers.fused import layer_ops

    cpp.load_kernel()                                        # built here first, if need be
    layer_ops(torch.float32, torch.device("cpu"))
    root = build_root()
    return str(root) if root.is_dir() else None


def child_binds() -> list[tuple[str, str]]:
    """(folder here, folder in the jail) for ``jail.plan``: the kernels, read-only."""
    root = built_extensions()
    return [(root, INSIDE)] if root is not None and os.path.isdir(root) else []
