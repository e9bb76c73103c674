"""Linear-layer kernels: who multiplies the activations by a weight matrix (notebook 04).

A decode step of a 135M-parameter model is mostly matrix products: ~3/4 of it at 128 rows on a
CPU (``make profile``). The same product can cost twice as much depending on the library that
computes it, so the kernel is a choice, like the attention backend:

* ``torch`` -- ``F.linear``: PyTorch's default, a BLAS call (MKL on x86) that repacks the weight
  into its own tiled layout on *every* call; cuBLAS on a GPU.
* ``onednn`` -- the weight is reordered once, at load time, into oneDNN's blocked layout for
  this CPU (``torch.ops.mkldnn._reorder_linear_weight``: what ``torch.compile`` does with
  ``freezing=True``), and each product reads it as it lies. A residual add rides along as a
  post-op (``h + x @ W.T`` in one pass over ``h``). ``make profile`` measures both chains.

``get_linear_kernel`` picks one by name, device and dtype; a ``Linear`` is one weight matrix with
the kernel's own copy of it. Both kernels compute the same fp32 product (they differ in the
order of the additions, ~1e-6 relative); the engine's tests compare tokens with Hugging Face's.
In bf16 (``--dtype bfloat16``, or ``auto`` on a CPU with AMX-BF16 / AVX512-BF16) oneDNN runs the
same reordered-weight product on the CPU's bf16 units, accumulating in fp32: at 16-256 rows
several times faster than fp32 where the CPU has them (``make profile``).
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from ..runtime.heap import gather, gathered
from .config import LINEAR_BACKENDS, QUANTIZATIONS
from .quant import get_quantized_kernel
# oneDNN picks its blocked layout for an expected number of rows; any number of rows then runs
# (measured on the lab CPU: a layout for 16 rows or for 128 differs by < 5% at 1-256 rows).
ROWS_HINT = 128


class TorchLinear:
    name = "torch"
    traceable = True    # plain torch ops: a compiled graph inlines them (rung 14)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(self, x, packed, bias=None, residual=None):
        y = F.linear(x, packed, bias)
        return y if residual is None else residual + y


class OneDNNLinear:
    """oneDNN's GEMM (fp32 or bf16) on weights reordered once (CPU only)."""

    name = "onednn"
    traceable = False   # its packed copy is opaque: a compiled graph calls it as a custom op

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        # an opaque tensor: same shape, oneDNN's memory layout, no storage Python can read
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)

    def __call__(self, x, packed, bias=None, residual=None):
        x = x.contiguous()
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), packed, bias,
                                                         "add")


class Linear:
    """``y = x @ weight.T + bias`` (+ ``residual``), computed by ``kernel`` on its own copy of
    the weight. ``weight`` stays the plain tensor (slice it, save it, compare it); the packed
    copy is rebuilt wherever a ``Linear`` is unpickled (a pipeline worker, rung 7), because a
    oneDNN layout belongs to the process and the CPU that made it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel):
        self.weight, self.bias, self.kernel = weight, bias, kernel
        self.packed = kernel.pack(weight)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel(x, self.packed, self.bias, residual)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __reduce__(self):
        return Linear, (self.weight, self.bias, self.kernel)


def gather_packed(linears: list[Linear]) -> int:
    """Move the weights ``linears``' kernels stream into one buffer on huge pages
    (``runtime/heap.py``'s ``gather``): a one-row decode step reads them all once, and on 4 KiB
    pages the prefetchers stop at every page. Moved: the kernels' own copies (int8 codes and
    scales) and the plain weights the model made (the fused q/k/v and gate/up); left: a weight
    already gathered (``load_model`` puts the Hugging Face module's there, and the module keeps
    holding it) and oneDNN's opaque copies. Returns the bytes moved."""
    slots = []
    for lin in linears:
        parts = lin.packed if isinstance(lin.packed, tuple) else (lin.packed,)
        for i, t in enumerate(parts):
            if (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel()
                    and t.device.type == "cpu" and t.is_contiguous() and not gathered(t)):
                slots.append((lin, i, t))
    moved = gather([t for _, _, t in slots]) if slots else []
    for (lin, i, old), new in zip(slots, moved):
        if lin.weight is old:          # the plain weight streamed as it is: one copy, not two
            lin.weight = new
        if isinstance(lin.packed, tuple):
            lin.packed = lin.packed[:i] + (new,) + lin.packed[i + 1:]
        else:
            lin.packed = new
    return sum(t.numel() * t.element_size() for t in moved)


def matmul_gflops(kernel, n: int = 2048, repeats: int = 5,
                  dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of one n x n x n product in ``dtype`` through ``kernel`` (best of ``repeats``): how
    fast this CPU multiplies matrices when the shapes suit it best (``make profile``, ``make
    bench``)."""
    import time

    g = torch.Generator().manual_seed(0)
    lin = Linear(torch.randn(n, n, generator=g).to(dtype), None, kernel)
    x = torch.randn(n, n, generator=g).to(dtype)
    lin(x)                                  # warm-up: the first call allocates
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        lin(x)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / min(times) / 1e9        # the best run: a peak, not a typical time


ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_works(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN's linear ops exist in this torch build and agree with ``F.linear`` on a small
    product in ``dtype`` (false on builds without oneDNN, e.g. some non-x86 wheels)."""
    if dtype not in ONEDNN_DTYPES:
        return False
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w, x, r = (torch.randn(s, generator=g).to(dtype) for s in ((24, 40), (5, 40), (5, 24)))
        k = OneDNNLinear()
        y, yr = k(x, k.pack(w)), k(x, k.pack(w), residual=r)
        ref = F.linear(x.float(), w.float())
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(y.float(), ref, atol=tol, rtol=tol)
                    and torch.allclose(yr.float(), r.float() + ref, atol=tol, rtol=tol))
    except Exception:   # missing op, unsupported CPU: the torch kernel always works
        return False


def get_linear_kernel(name: str | None, device, dtype: torch.dtype):
    """``torch``, ``onednn``, or rung 14's ``gemv`` (layers/gemv.py) and ``tiled`` (gemv up to
    8 rows, layers/tiled.py above; where it cannot run, one warning and gemv). By default
    onednn for fp32 and bf16 on the CPU where it works, torch otherwise (a GPU's cuBLAS needs
    no help; fp16 on a CPU stays on torch's path). Asking
    for onednn where it cannot run warns once and uses torch: same tokens, slower. ``int8`` and
    ``w8a8`` are rung 14's kernels on int8 weights (quant.py), named by
    ``ModelConfig.quantization``; w8a8 where the CPU has no int8 units is a RuntimeError."""
    device = torch.device(device)
    fits = device.type == "cpu" and onednn_works(dtype)
    if name is None:
        return OneDNNLinear() if fits else TorchLinear()
    if name == "torch":
        return TorchLinear()
    if name == "onednn":
        if fits:
            return OneDNNLinear()
        warnings.warn(f"linear_backend='onednn' cannot run here (device {device.type}, dtype "
                      f"{dtype}, oneDNN {'works' if onednn_works() else 'unavailable'}): using "
                      f"torch's F.linear", RuntimeWarning, stacklevel=2)
        return TorchLinear()
    if name == "gemv":
        from .gemv import GemvLinear
        return GemvLinear(OneDNNLinear() if fits else TorchLinear())
    if name == "tiled":
        from . import tiled
        from .gemv import GemvLinear
        why = tiled.why_not(device, dtype)
        if why is None:
            return tiled.GemvTiledLinear()
        warnings.warn(f"linear_backend='tiled' cannot run here: {why}; using gemv",
                      RuntimeWarning, stacklevel=2)
        return GemvLinear(OneDNNLinear() if fits else TorchLinear())
    if name == "int8":
        from .gemv import int8_kernel
        return int8_kernel(device)
    if name == "w8a8":
        from .gemv import w8a8_kernel
        return w8a8_kernel(device)
    if name in QUANTIZATIONS:
        return get_quantized_kernel(name, device)
    raise ValueError(f"unknown linear_backend {name!r}: choose "
                     f"{' or '.join(map(repr, LINEAR_BACKENDS))}")


__all__ = ["LINEAR_BACKENDS", "Linear", "OneDNNLinear", "TorchLinear", "gather_packed",
           "get_linear_kernel", "matmul_gflops", "onednn_works"]
