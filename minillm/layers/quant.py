"""Rung 14 — int8 weights: the linear layers' matrices stored in 8 bits (notebook 14).

A decode step at one row reads every weight once and does two FLOPs per weight read, so its
time is the weights' bytes over the memory bandwidth: 540 MB for SmolLM2 in fp32, 270 MB in
bf16, 135 MB in int8. ``quantization`` (``ModelConfig``) names one of two kernels:

* ``"int8"`` -- weight-only (gpt-fast's ``int8``): each output channel (a row of ``W``) gets
  one scale, ``s = max|W_row| / 127``; the row is stored as ``q = clamp(round(W / s), -127,
  127)``. The product is ``(x @ q.T) * s``: the scale is per output column of ``y``, so it
  comes out of the sum. The activations stay in the model's dtype. A scale per *tensor*
  would let one large row set the step for all: the small rows would keep a few levels.
* ``"w8a8"`` -- int8 activations too (SmoothQuant's layout without its smoothing): each token
  (a row of ``x``) gets its own scale when it arrives (dynamic), the product is an int8 x int8
  GEMM with int32 accumulation, ``y = (xq @ q.T) * s_x[:, None] * s_w[None, :]``. It pays only
  where the CPU multiplies int8 in hardware (VNNI's ``vpdpbusd`` or AMX-INT8); elsewhere it is
  refused with one line naming what is missing.

How the weight-only product is computed depends on the CPU and the rows (measured,
docs/rungs/14_compiled.md): ``torch.ops.aten._weight_int8pack_mm`` (what gpt-fast calls) has an
AVX-512 kernel for a few bf16 rows; everywhere else (fp32 rows, many rows, a CPU with AVX2 only)
the int8 weight is widened to the activations' dtype inside the call (``dequant``) and multiplied
by BLAS -- an extra pass over it, but exact to the same product. Decode rows in fp32 (up to 8)
go to rung 14's streamed kernel instead (``layers/gemv.py``: one byte per weight read, widened in
registers).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .config import QUANTIZATIONS

QMAX = 127       # symmetric: -127..127, so -q is representable and 0 is exact
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")    # /proc/cpuinfo's names


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale fp32 [out]): one scale per output channel (row), symmetric,
    rounded then clamped to [-127, 127]. An all-zero row gets scale 1 (its q is 0 anyway)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [T, in], scale fp32 [T]): the activations' own scale per row, computed per call."""
    return quantize_per_channel(x)      # a token is a row of x, as a channel is a row of W


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def has_int8pack_kernel() -> bool:
    """torch's ``_weight_int8pack_mm`` has a fast CPU kernel here (AVX-512)."""
    return "AVX512" in torch.backends.cpu.get_cpu_capability()


INT8PACK_MAX_ROWS = 16      # past this, widening then BLAS won (measured, AVX-512 host)


def int8_path(device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
              rows: int | None = None) -> str:
    """``int8pack`` (``aten._weight_int8pack_mm``) or ``dequant`` (widen, then BLAS): the faster
    one, as measured (docs/rungs/14_compiled.md). Without ``dtype``: whether the fast kernel
    exists at all (a CPU with AVX-512). With it: on that host, int8pack for bf16 or fp16 rows,
    up to ``INT8PACK_MAX_ROWS`` of them; fp32 rows took 10-35x longer on it than widening."""
    if torch.device(device).type != "cpu" or not has_int8pack_kernel():
        return "dequant"
    return "int8pack" if dtype is None else int8_path_with_kernel(dtype, rows or 1)


def int8_path_with_kernel(dtype: torch.dtype, rows: int) -> str:
    """``int8_path`` where the fast kernel exists: a rule on the product alone, so a compiled
    graph can apply it while tracing (asking torch for the CPU's capability there would not
    trace). ``rows`` may be a symbol (rung 14's dynamic graph): the fast kernel only where it
    holds for every row count, with no guard added."""
    fast = (dtype in (torch.bfloat16, torch.float16)
            and statically_known_true(rows <= INT8PACK_MAX_ROWS))
    return "int8pack" if fast else "dequant"


class Int8Linear:
    """Weight-only int8 with per-output-channel scales (``quantization="int8"``)."""

    name = "int8"
    traceable = True

    def __init__(self, path: str | None = None):
        if path not in (None, "int8pack", "dequant"):
            raise ValueError(f"unknown int8 path {path!r}: choose 'int8pack' or 'dequant'")
        self.path = path

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_per_channel(weight)
        # the scale in the activations' dtype: _weight_int8pack_mm takes them alike
        return q.to(weight.device), scale.to(weight.device, weight.dtype)

    def __call__(self, x, packed, bias=None, residual=None):
        q, scale = packed
        path = self.path or int8_path(x.device, x.dtype, x.numel() // max(x.shape[-1], 1))
        if path == "int8pack" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), q,
                                                   scale).view(*x.shape[:-1], q.shape[0])
        else:
            y = F.linear(x, q.to(x.dtype)) * scale
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y


class W8A8Linear:
    """int8 activations (per token, dynamic) x int8 weights (per channel), int32 accumulation
    (``torch._int_mm``, oneDNN's int8 GEMM on the CPU) (``quantization="w8a8"``)."""

    name = "w8a8"
    traceable = True

    def pack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_per_channel(weight)
        return q.t().contiguous().t(), scale     # [out, in] viewed from a [in, out] layout

    def __call__(self, x, packed, bias=None, residual=None):
        q, scale = packed
        flat = x.reshape(-1, x.shape[-1])
        xq, xs = quantize_per_token(flat)
        acc = torch._int_mm(xq, q.t())          # [T, out] int32: the exact integer sums
        y = (acc.float() * xs[:, None] * scale[None, :]).to(x.dtype)
        y = y.view(*x.shape[:-1], q.shape[0])
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y


def w8a8_missing(device: torch.device | str = "cpu") -> str | None:
    """Why ``w8a8`` cannot run here (one line naming what is missing), or None where it can: a
    CPU with int8 dot-product instructions and a torch whose int8 GEMM answers correctly."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"quantization='w8a8' is built for the CPU's int8 units; device {device.type}"
    flags = cpu_flags()
    if not flags & set(VNNI_FLAGS):
        return ("quantization='w8a8' needs int8 dot-product instructions (AVX512-VNNI, AVX-VNNI "
                f"or AMX-INT8); this CPU has none (torch sees "
                f"{torch.backends.cpu.get_cpu_capability()}): use quantization='int8'")
    try:
        # the integer product is exact or wrong: compare it with int64 sums, not with fp32's
        # (the quantization's own error is rung 14's accuracy table, not a fault of the CPU)
        g = torch.Generator().manual_seed(0)
        xq = torch.randint(-127, 128, (5, 64), generator=g, dtype=torch.int8)
        wq = torch.randint(-127, 128, (24, 64), generator=g, dtype=torch.int8)
        if not torch.equal(torch._int_mm(xq, wq.t()).long(), xq.long() @ wq.long().t()):
            return "quantization='w8a8': torch._int_mm gave a wrong product on this CPU"
    except Exception as e:        # an op this build lacks: say which
        return f"quantization='w8a8': torch._int_mm failed here ({type(e).__name__}: {e})"
    return None


def get_quantized_kernel(name: str, device):
    """The kernel ``quantization=name`` runs; w8a8 where it cannot run is a RuntimeError."""
    if name == "int8":
        return Int8Linear()
    if name == "w8a8":
        why = w8a8_missing(device)
        if why is not None:
            raise RuntimeError(why)
        return W8A8Linear()
    raise ValueError(f"unknown quantization {name!r}: choose "
                     f"{' or '.join(map(repr, QUANTIZATIONS))}")


__all__ = ["Int8Linear", "QMAX", "QUANTIZATIONS", "W8A8Linear", "dequantize_per_channel",
           "get_quantized_kernel", "has_int8pack_kernel", "int8_path",
           "int8_path_with_kernel", "quantize_per_channel", "quantize_per_token",
           "w8a8_missing"]
