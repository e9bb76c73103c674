"""Paged decode attention as a small C++ kernel for the CPU (notebook 04 compares it).

``TorchAttention.decode`` gathers every sequence's K/V rows out of the block pools into one padded
tensor, and SDPA then reads that copy: each context row is moved three times per layer and step.
``csrc/paged_decode.cpp`` follows the block table itself and reads each K/V row once, for all the
query heads that share it -- on the CPU, what the Triton kernel of rung 4 does on a GPU. Prefill
chunks (``extend``) keep the torch path: they are a small part of a serving step.

The kernel is compiled on first use with ``torch.utils.cpp_extension`` (about a minute; cached in
``~/.cache/torch_extensions``) and needs a C++ compiler and ``ninja``. Where it cannot be built
(no compiler, Windows without MSVC, ``MINILLM_CPP=0``) the engine says why once and falls back to
the torch reference: the tokens are the same either way.
"""
from __future__ import annotations

import os
import platform
import sys
import threading
import warnings
import zlib
from pathlib import Path

import torch

from .reference import TorchAttention

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_lock = threading.Lock()
_state: dict = {}          # "module" once built, or "error": why it could not be


def _flags() -> tuple[list[str], list[str]]:
    cflags, ldflags = ["-O3", "-ffast-math"], []
    if sys.platform.startswith("linux"):
        cflags.append("-fopenmp")      # at::parallel_for splits (sequence, head) pairs over threads
        ldflags.append("-fopenmp")
    if platform.machine() in ("x86_64", "AMD64"):
        cflags.append("-march=native")  # built here, for this CPU: AVX2/AVX-512 where it has them
    return cflags, ldflags


def _build_name() -> str:
    """``-march=native`` code must never run on another CPU (a shared home directory in a
    classroom): the build is named after this CPU's feature flags."""
    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"minillm_paged_decode_{zlib.crc32((platform.machine() + flags).encode()):08x}"


def load_kernel():
    """The compiled extension, or ``None`` (with the reason in ``kernel_error()``)."""
    with _lock:
        if "module" in _state or "error" in _state:
            return _state.get("module")
        if os.environ.get("MINILLM_CPP", "1") == "0":
            _state["error"] = "MINILLM_CPP=0"
            return None
        try:
            from torch.utils.cpp_extension import load
            cflags, ldflags = _flags()
            _state["module"] = load(_build_name(), [str(_SOURCE)], extra_cflags=cflags,
                                    extra_ldflags=ldflags, verbose=False)
        except Exception as e:     # no compiler, no ninja, a failed build: fall back, say why
            _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
            warnings.warn(f"the C++ paged-attention kernel could not be built ({_state['error']}); "
                          f"using the torch reference (same tokens, slower decode)", stacklevel=3)
        return _state.get("module")


def kernel_error() -> str | None:
    return _state.get("error")


def cpp_available() -> bool:
    return load_kernel() is not None


class CppAttention(TorchAttention):
    """Rung 3's attention with the decode part in C++ (CPU, fp32/fp64); everything else, and any
    other device or dtype, is the torch reference."""

    name = "cpp"

    def __init__(self):
        super().__init__()
        self.kernel = load_kernel()

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        if (self.kernel is None or q.device.type != "cpu"
                or q.dtype not in (torch.float32, torch.float64)):
            return super().decode(q, k_cache, v_cache, block_tables, context_lens, scale)
        return self.kernel.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
