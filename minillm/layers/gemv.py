"""Rung 14's one-row product: a few decode rows times a weight matrix, the weight streamed once
(``csrc/gemv.cpp``; notebook 14 and docs/rungs/14_compiled.md measure it).

One stream's step is a chain of products with one row of activations: each reads its whole
weight for two FLOPs per weight, so it runs at the memory's speed or not at all. BLAS and oneDNN
tile W for reuse across many rows; at one row they kept the lab CPU's memory half idle. The
kernel here reads each row of W once for all the rows of x together and, for int8 weights, moves
one byte per weight (widened in registers, the row's scale applied to its sum). Above
``MAX_ROWS`` rows the tiles win again, and the kernels below hand the product to the one they
extend. It builds like the attention kernel (once per toolchain; without a compiler, the
fallback kernel and one warning saying why).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .attention.cpp import load_extension
from .quant import Int8Linear, int8_path

_SOURCE = Path(__file__).with_name("csrc") / "gemv.cpp"
_state: dict = {}
MAX_ROWS = 8        # decode batches up to this many rows take the streamed product


def load():
    """The built kernel module, or None (the reason in ``error()``)."""
    return load_extension(_SOURCE, _state, "the one-row product kernel (gemv)",
                          "the kernel it extends", stem="minillm_gemv")


def error() -> str | None:
    return _state.get("error")


def _module():
    """The built module without ``load``'s lock once it is loaded: this is on every product of
    the decode loop."""
    return _state["module"] if "module" in _state else load()


def gemv(x: torch.Tensor, weight: torch.Tensor, scale=None, bias=None, residual=None):
    """``x @ weight.T`` (``* scale`` per output row) ``+ bias + residual`` for x [..., in] fp32 and
    an fp32 or int8 weight [out, in]: the kernel's call with shapes and layouts made right."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    res = None if residual is None else residual.reshape(flat.shape[0], -1).float().contiguous()
    y = _module().gemv(flat.contiguous(), weight,
                    None if scale is None else scale.float().contiguous(),
                    None if bias is None else bias.float().contiguous(), res)
    return y.view(*lead, weight.shape[0])


def fits(x: torch.Tensor) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.device.type == "cpu" and x.dtype == torch.float32 and 0 < rows <= MAX_ROWS
            and _module() is not None)


class GemvLinear:
    """fp32 weights (``linear_backend="gemv"``): up to ``MAX_ROWS`` rows streamed by the kernel,
    more rows by ``base`` (oneDNN on its packed copy where it works, else ``F.linear``)."""

    name = "gemv"
    traceable = False       # a compiled graph calls it as a custom op (r14_compiled/ops.py)

    def __init__(self, base):
        self.base = base

    def pack(self, weight: torch.Tensor):
        return weight.contiguous(), self.base.pack(weight)

    def __call__(self, x, packed, bias=None, residual=None):
        plain, based = packed
        if fits(x):
            return gemv(x, plain, None, bias, residual)
        return self.base(x, based, bias, residual)


class Int8GemvLinear(Int8Linear):
    """int8 weights (``quantization="int8"`` where the kernel builds and torch has no AVX-512
    int8 product): up to ``MAX_ROWS`` fp32 rows read the int8 weight directly; otherwise
    ``Int8Linear``'s own paths."""

    name = "int8"
    traceable = False

    def __call__(self, x, packed, bias=None, residual=None):
        if fits(x):
            q, scale = packed
            return gemv(x, q, scale, bias, residual)
        return super().__call__(x, packed, bias, residual)


def int8_kernel(device) -> Int8Linear:
    """``quantization="int8"``'s kernel. Where torch has no fast int8 product (a CPU without
    AVX-512: ``int8_path`` says ``dequant``) and this kernel builds, decode rows come here
    straight from the int8 weight: measured, far faster than widening it (docs/rungs/
    14_compiled.md)."""
    if torch.device(device).type == "cpu" and int8_path(device) == "dequant" and load() is not None:
        return Int8GemvLinear()
    return Int8Linear()


__all__ = ["GemvLinear", "Int8GemvLinear", "MAX_ROWS", "error", "fits", "gemv", "int8_kernel",
           "load"]
