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
from .quant import Int8Linear, W8A8Linear, get_quantized_kernel, quantize_per_channel

_SOURCE = Path(__file__).with_name("csrc") / "gemv.cpp"
_state: dict = {}
MAX_ROWS = 8        # decode batches up to this many rows take the streamed product

# torch.ops.minillm.gemv: declared here, computed by the C++ source once it is loaded (its
# TORCH_LIBRARY_IMPL). As an operator it is one node of a compiled graph, called from the
# generated code with no Python of ours around it (rung 14's graph.py).
torch.library.define("minillm::gemv", "(Tensor x, Tensor w, Tensor? scale, Tensor? bias, "
                     "Tensor? residual) -> Tensor")


torch.library.define("minillm::gemv_w8a8", "(Tensor x, Tensor w, Tensor scale, Tensor? bias, "
                     "Tensor? residual) -> Tensor")


@torch.library.register_fake("minillm::gemv")
def _(x, w, scale, bias, residual):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("minillm::gemv_w8a8")
def _(x, w, scale, bias, residual):
    return x.new_empty(x.shape[0], w.shape[0])


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
    return _call(torch.ops.minillm.gemv, x, weight, scale, bias, residual)


def _call(op, x, weight, scale, bias, residual):
    """``op`` (gemv or gemv_w8a8) on x flattened to [rows, in], scale and bias as fp32, the
    residual as x's rows in x's dtype; y given x's leading dimensions back."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    res = None if residual is None else \
        residual.reshape(flat.shape[0], -1).to(flat.dtype).contiguous()
    y = op(flat, weight, None if scale is None else scale.float().contiguous(),
           None if bias is None else bias.float().contiguous(), res)
    return y.view(*x.shape[:-1], weight.shape[0])


STREAM_DTYPES = (torch.float32, torch.bfloat16)     # the activations gemv takes


def fits(x: torch.Tensor, dtypes: tuple = STREAM_DTYPES) -> bool:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.device.type == "cpu" and x.dtype in dtypes and 0 < rows <= MAX_ROWS
            and _module() is not None)


class StreamedLinear:
    """A kernel whose few-row products are ``minillm::gemv`` on plain tensors (``stream``) and
    whose other products are its own. A compiled graph (rung 14, graph.py) holds the plain
    tensors as buffers and calls the operator inline for its buckets of up to ``MAX_ROWS``."""

    traceable = False       # its many-row path may be opaque: the graph asks ``stream`` first
    stream_dtypes = STREAM_DTYPES       # the activations ``stream`` takes

    def stream_tensors(self, packed) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, per-row scale or None): what ``minillm::gemv`` reads."""
        raise NotImplementedError

    def stream(self, x, tensors, bias=None, residual=None):
        weight, scale = tensors
        return gemv(x, weight, scale, bias, residual)


class GemvLinear(StreamedLinear):
    """fp32 or bf16 weights (``linear_backend="gemv"``): up to ``MAX_ROWS`` rows streamed by the
    kernel, more rows by ``base`` (oneDNN on its packed copy where it works, else ``F.linear``)."""

    name = "gemv"

    def __init__(self, base):
        self.base = base

    def pack(self, weight: torch.Tensor):
        return weight.contiguous(), self.base.pack(weight)

    def stream_tensors(self, packed):
        return packed[0], None

    def __call__(self, x, packed, bias=None, residual=None):
        plain, based = packed
        if fits(x):
            return gemv(x, plain, None, bias, residual)
        return self.base(x, based, bias, residual)


class Int8GemvLinear(Int8Linear, StreamedLinear):
    """int8 weights (``quantization="int8"`` where the kernel builds): up to ``MAX_ROWS`` fp32 or
    bf16 rows read the int8 weight directly; otherwise ``Int8Linear``'s own paths."""

    name = "int8"
    traceable = False

    def stream_tensors(self, packed):
        q, scale = packed
        return q, scale

    def __call__(self, x, packed, bias=None, residual=None):
        if fits(x):
            return self.stream(x, self.stream_tensors(packed), bias, residual)
        return super().__call__(x, packed, bias, residual)


class W8A8GemvLinear(W8A8Linear, StreamedLinear):
    """w8a8 (``quantization="w8a8"``) where the kernel was built with AVX512-VNNI: up to
    ``MAX_ROWS`` fp32 rows are quantized per token and multiplied by ``vpdpbusd`` in the C++
    kernel (the same integer sums as ``torch._int_mm``, scaled alike); more rows are
    ``W8A8Linear``'s ``_int_mm``."""

    name = "w8a8"
    traceable = False
    stream_dtypes = (torch.float32,)    # per-token codes from fp32 rows

    def pack(self, weight: torch.Tensor):
        q, scale = quantize_per_channel(weight)
        return q.contiguous(), scale            # rows of W contiguous: the kernel streams them

    def stream_tensors(self, packed):
        return packed

    def stream(self, x, tensors, bias=None, residual=None):
        q, scale = tensors
        return _call(torch.ops.minillm.gemv_w8a8, x, q, scale, bias, residual)

    def __call__(self, x, packed, bias=None, residual=None):
        if fits(x, self.stream_dtypes):
            return self.stream(x, packed, bias, residual)
        return super().__call__(x, packed, bias, residual)


def w8a8_kernel(device) -> W8A8Linear:
    """``quantization="w8a8"``'s kernel (refused by name where the CPU has no int8 units): decode
    rows through the VNNI kernel where it was built with it."""
    kernel = get_quantized_kernel("w8a8", device)
    module = load() if torch.device(device).type == "cpu" else None
    return W8A8GemvLinear() if module is not None and module.has_vnni() else kernel


def int8_kernel(device) -> Int8Linear:
    """``quantization="int8"``'s kernel. On a CPU where this kernel builds, decode rows come here
    straight from the int8 weight: measured faster than widening it (AVX2 host) and than
    torch's AVX-512 ``_weight_int8pack_mm`` (AVX-512 host), docs/rungs/14_compiled.md."""
    if torch.device(device).type == "cpu" and load() is not None:
        return Int8GemvLinear()
    return Int8Linear()


__all__ = ["GemvLinear", "Int8GemvLinear", "MAX_ROWS", "STREAM_DTYPES", "StreamedLinear",
           "W8A8GemvLinear", "w8a8_kernel", "error", "fits", "gemv", "int8_kernel",
           "load"]
