"""Rung 4: paged attention as Triton kernels (notebook ``notebooks/04_triton_kernels.ipynb``).

Rung 3's ``TorchAttention`` reads the paged KV cache by *gathering* every sequence's blocks into a
fresh contiguous tensor, then calling ordinary SDPA. That copy costs as much memory traffic as the
attention itself, and it is padded to the longest sequence of the batch. Here the kernels read the
blocks *in place*, through the block table, one block at a time:

* ``kernels.store_kv``: scatter the new tokens' K/V into their cache slots;
* ``kernels.paged_decode``: one query token per sequence, online softmax over its blocks, the
  query heads of a GQA group sharing each K/V load; a split-KV ("flash-decoding") variant spreads
  one long sequence over several programs when the batch alone cannot fill the GPU;
* ``kernels.paged_extend``: a chunk of new tokens per sequence attends causally to the cached
  prefix and to itself (prefill, chunked prefill, prefix caching).

``kernels.py`` holds the kernels (device code, read top to bottom); ``launch.py`` the Python
functions that check shapes and launch them (re-exported by ``kernels``, and importable without
triton); ``backend.TritonAttention`` puts them behind the same three methods as ``TorchAttention``.
All three take rung 9's narrow pools too (``layers/kv_quant.py``): int8/fp8 rows with a scale each,
or 16-bit rows, quantized inside the store kernel and widened inside the attention kernels' loads.

Without a GPU, Triton can still run the kernels through its *interpreter* (numpy, on CPU tensors,
slow but exact), which is how the tests run. The interpreter is chosen when a kernel is decorated,
so ``TRITON_INTERPRET=1`` must be in the environment before ``kernels`` is imported: this package
sets it (if the user has not) whenever CUDA is unavailable.
"""
from __future__ import annotations

import os
import platform
import re
import sys

import torch

from ..triton_mode import choose_triton_mode

choose_triton_mode()


def triton_available() -> bool:
    """True when the Triton kernels can run here: natively on CUDA, or through the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if torch.cuda.is_available():
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and _interpreter_problem() is None


def _version(v: str) -> tuple[int, int]:
    major, minor = (int(x) for x in re.findall(r"\d+", v)[:2])
    return major, minor


def _interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run the kernels with these versions, if it cannot.

    The interpreters of triton < 3.7 call ``int()`` on one-element arrays, which numpy >= 2.4
    refuses (tested: triton 3.2 and 3.6 fail with numpy 2.4 and pass with 2.3; 3.7.1 passes).
    The CUDA builds of torch < 2.13 pin such a triton; on a GPU the interpreter is not used.
    """
    import numpy
    import triton
    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        return (f"the CPU interpreter of triton {triton.__version__} fails with numpy "
                f"{numpy.__version__}: pip install 'numpy<2.4', or a triton >= 3.7 (torch 2.13's "
                f"CUDA build brings 3.7.1)")
    return None


class TritonUnavailableError(ImportError):
    """Rung 4 was asked for where its kernels cannot run (no triton, or no way to run it)."""


# Triton publishes wheels for these only (no source distribution): see requirements.txt.
_TRITON_WHEELS = {("linux", "x86_64"), ("linux", "aarch64")}


def require_triton() -> None:
    """Raise ``TritonUnavailableError``, saying what to do, unless ``triton_available()``."""
    torch_backend = "use attention_backend='torch' (--attention torch); rungs 0-3 need no triton"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        where = f"{sys.platform}/{platform.machine()}"
        if (sys.platform, platform.machine().lower()) in _TRITON_WHEELS:
            how = (f"Install it with `pip install triton` (without CUDA its interpreter runs the "
                   f"kernels on CPU), or {torch_backend}")
        else:
            how = (f"Triton has no wheel for {where} (only for Linux x86-64 and aarch64): run "
                   f"rung 4 on Linux, or {torch_backend}")
        raise TritonUnavailableError(
            f"the 'triton' attention backend (rung 4) needs the triton package, which cannot be "
            f"imported here ({e}). {how}.") from e
    if torch.cuda.is_available():
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise TritonUnavailableError(
            "the 'triton' attention backend (rung 4) needs CUDA or Triton's CPU interpreter, but "
            f"there is no CUDA device and TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}: "
            f"unset TRITON_INTERPRET (or set it to 1) before starting Python, or {torch_backend}.")
    problem = _interpreter_problem()
    if problem:
        raise TritonUnavailableError(
            f"the 'triton' attention backend (rung 4) cannot run here: {problem}; "
            f"or {torch_backend}.")


def __getattr__(name: str):
    # Imported lazily so that ``import minillm.layers.attention.triton`` works without triton installed;
    # asking for the backend without triton raises TritonUnavailableError (an ImportError).
    if name == "TritonAttention":
        require_triton()
        from .backend import TritonAttention
        return TritonAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TritonAttention", "TritonUnavailableError", "require_triton", "triton_available"]
