"""Paged decode attention as a small C++ kernel for the CPU (notebook 04 compares it).

``TorchAttention.decode`` gathers every sequence's K/V rows out of the block pools into one padded
tensor, and SDPA then reads that copy: each context row is moved three times per layer and step.
``csrc/paged_decode.cpp`` follows the block table itself and reads each K/V row once, for all the
query heads that share it -- on the CPU, what the Triton kernel of rung 4 does on a GPU. Prefill
chunks (``extend``) of a bf16 model on a bf16 pool go through the same source's ``paged_extend``
where the CPU has AVX512-BF16; every other prefill keeps the torch path.

The kernel is compiled on first use with ``torch.utils.cpp_extension`` (about 45 s, one line on
stderr says so) and needs a C++ compiler and ``ninja``. ``cpp_build.py`` caches it under torch's
extensions root (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``) in a directory
named after everything in the build (torch version and path, Python, compiler, flags, source,
CPU), so checkouts and venvs sharing a home directory neither rebuild it for each other nor wait
on a killed build's lock; a build that cannot finish within ``MINILLM_CPP_BUILD_TIMEOUT_S``
(default 300 s) is stopped. Where it cannot be built (no compiler, a failed or overrunning build,
``MINILLM_CPP=0``) the engine says why once and falls back to the torch reference: the tokens are
the same either way.
"""
from __future__ import annotations

import os
import platform
import sys
import threading
import warnings
from pathlib import Path

import torch

from ..kv_quant import QuantizedPool
from . import cpp_build
from .reference import TorchAttention

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
_lock = threading.Lock()
_state: dict = {}          # "module" once built, or "error": why it could not be

# torch.ops.minillm.decode_step_attention: one layer's attention in a compiled decode step (rung
# 14), computed by the C++ source once it is loaded (csrc/decode_step.h, its TORCH_LIBRARY_IMPL),
# reading the pools and tables from the step's context that ``CppAttention.step_context`` sets.
torch.library.define("minillm::decode_step_attention",
                     "(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")


@torch.library.register_fake("minillm::decode_step_attention")
def _(q, k, v, layer):
    return q.new_empty(q.shape)       # contiguous, as the kernel returns it


def _flags() -> tuple[list[str], list[str]]:
    cflags, ldflags = ["-O3", "-ffast-math"], []
    if sys.platform.startswith("linux"):
        cflags.append("-fopenmp")      # at::parallel_for splits (sequence, head) pairs over threads
        ldflags.append("-fopenmp")
    if platform.machine() in ("x86_64", "AMD64"):
        cflags.append("-march=native")  # built here, for this CPU: AVX2/AVX-512 where it has them
    return cflags, ldflags


def load_kernel():
    """The compiled extension, or ``None`` (with the reason in ``kernel_error()``)."""
    return load_extension(_SOURCE, _state, "the C++ paged-attention kernel",
                          "the torch reference (same tokens, slower decode)")


def load_extension(source: Path, state: dict, what: str, fallback: str, stem: str | None = None):
    """Build (once per toolchain) and import ``source``, or ``None`` with the reason kept in
    ``state["error"]`` and said once: ``what`` could not be built, ``fallback`` is used instead.
    The fused layer ops (``layers/fused.py``) load the same way."""
    with _lock:
        if "module" in state or "error" in state:
            return state.get("module")
        if os.environ.get("MINILLM_CPP", "1") == "0":
            state["error"] = "MINILLM_CPP=0"
            return None
        cpp_build.build_timeout_s()   # a bad MINILLM_CPP_BUILD_TIMEOUT_S: an error, no fallback
        try:
            state["module"] = cpp_build.load_cached(source, *_flags(), **({"stem": stem} if stem else {}))
        except Exception as e:     # no compiler, no ninja, a failed or overrunning build: say why
            state["error"] = error_line(e)
            warnings.warn(f"{what} could not be built ({state['error']}); using {fallback}",
                          stacklevel=4)
        return state.get("module")


def error_line(e: Exception) -> str:
    """One line for the warning: a compiler's error output can run to pages."""
    if isinstance(e, cpp_build.BuildError):
        return str(e)
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1][:300] if text else ''}"


def kernel_error() -> str | None:
    return _state.get("error")


def cpp_available() -> bool:
    return load_kernel() is not None


class CppAttention(TorchAttention):
    """Rung 3's attention with the decode part in C++ (CPU; fp32/fp64 queries, bf16/fp16 ones
    computed in fp32; pools in the model's type or, rung 9, a narrower one with scales);
    everything else, and any other device or dtype, is the torch reference."""

    name = "cpp"

    def __init__(self):
        super().__init__()
        self.kernel = load_kernel()
        # asked once, not in each layer's prefill: whether this build has the bf16 prefill
        self.extends_bf16 = self.kernel is not None and self.kernel.extend_in_place()

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        if (self.kernel is None or q.device.type != "cpu"
                or q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16)):
            return super().decode(q, k_cache, v_cache, block_tables, context_lens, scale)
        # A 16-bit model (--dtype bfloat16) computes attention in fp32 as the torch reference's
        # softmax does: the kernel widens the query (a few KB) and the pool's 16-bit rows as it
        # reads them -- the context is never copied -- and takes a bf16 query's dot products
        # with bf16 ones in place where the CPU has them (AVX512-BF16).
        if isinstance(k_cache, QuantizedPool):    # stored narrow: widened inside the kernel
            return self.kernel.paged_decode(q, k_cache.data, v_cache.data, k_cache.scale,
                                            v_cache.scale, block_tables, context_lens, scale)
        return self.kernel.paged_decode(q, k_cache, v_cache, None, None, block_tables,
                                        context_lens, scale)

    def serves_step(self, caches: list) -> bool:
        """Whether ``decode_step_attention`` computes a compiled decode step on these pools:
        CPU tensors, plain or a rung 9 pool of 16-bit casts (a pool with scales keeps the Python
        op, ops.py of rung 14)."""
        return self.kernel is not None and all(
            _plain(k) is not None and _plain(v) is not None and k.device.type == "cpu"
            for k, v in caches)

    def step_context(self, caches: list, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, rows: int, scale: float) -> "_StepContext":
        """``with backend.step_context(...):`` -- the pools, slots, tables and lengths every
        layer's ``decode_step_attention`` reads during one compiled call, on this thread."""
        return _StepContext(self.kernel, caches, slot_mapping, block_tables, context_lens, rows,
                            scale)

    def extend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
        # A bf16 model on a bf16 pool prefills in the kernel too, on the CPU's bf16 units (where it
        # has AVX512-BF16): torch's flash kernel for the CPU is slower in bf16 than in fp32 here,
        # and was 31% of a long prompt's prefill. Anything else is the torch reference.
        if (self.extends_bf16 and q.device.type == "cpu" and q.dtype == torch.bfloat16
                and type(k_cache) is torch.Tensor and k_cache.dtype == torch.bfloat16
                and q.shape[-1] in (64, 128) and q.shape[1] // k_cache.shape[2] <= 16
                and k_cache.numel() < 2 ** 32):
            return self.kernel.paged_extend(q, k_cache, v_cache, meta.prefill_block_tables,
                                            meta.prefill_cu_seqlens_q, meta.prefill_context_lens,
                                            scale)
        return super().extend(q, k_new, v_new, k_cache, v_cache, meta, scale)


def _plain(pool) -> torch.Tensor | None:
    """The tensor a pool's rows are in, where they need no scale: the pool itself, or a 16-bit
    cast's storage (the new rows are cast to it as they are written, decode_step.h)."""
    if type(pool) is torch.Tensor:
        return pool
    if isinstance(pool, QuantizedPool) and pool.scale is None:
        return pool.data
    return None


class _StepContext:
    def __init__(self, kernel, caches, slot_mapping, block_tables, context_lens, rows, scale):
        self.kernel = kernel
        self.args = ([_plain(k) for k, _ in caches], [_plain(v) for _, v in caches], slot_mapping,
                     block_tables.contiguous(), context_lens.contiguous(), rows, scale)

    def __enter__(self):
        self.kernel.set_step_context(*self.args)

    def __exit__(self, *exc):
        self.kernel.clear_step_context()
