"""Step 4: paged attention as Triton kernels (notebook ``notebooks/04_triton_kernels.ipynb``).

Step 3's ``TorchAttention`` reads the paged KV cache by *gathering* every sequence's blocks into a
fresh contiguous tensor, then calling ordinary SDPA. That copy costs as much memory traffic as the
attention itself, and it is padded to the longest sequence of the batch. Here the kernels read the
blocks *in place*, through the block table, one block at a time:

* ``kernels.store_kv``: scatter the new tokens' K/V into their cache slots;
* ``kernels.paged_decode``: one query token per sequence, online softmax over its blocks, the
  query heads of a GQA group sharing each K/V load; a split-KV ("flash-decoding") variant spreads
  one long sequence over several programs when the batch alone cannot fill the GPU;
* ``kernels.paged_extend``: a chunk of new tokens per sequence attends causally to the cached
  prefix and to itself (prefill, chunked prefill, prefix caching).

``backend.TritonAttention`` wraps them behind the same three methods as ``TorchAttention``.

Without a GPU, Triton can still run the kernels through its *interpreter* (numpy, on CPU tensors,
slow but exact), which is how the tests run. The interpreter is chosen when a kernel is decorated,
so ``TRITON_INTERPRET=1`` must be in the environment before ``kernels`` is imported: this package
sets it (if the user has not) whenever CUDA is unavailable.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_available() -> bool:
    """True when the Triton kernels can run here: natively on CUDA, or through the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def __getattr__(name: str):
    # Imported lazily so that ``import minillm.engines.s4_triton`` works without triton installed.
    if name == "TritonAttention":
        from .backend import TritonAttention
        return TritonAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["TritonAttention", "triton_available"]
