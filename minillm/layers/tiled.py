"""Rung 14's tiled product: a decode batch of rows times a weight, held in register tiles
(``csrc/tiled.cpp``; docs/rungs/14_compiled.md measures it).

A decode step at 9-100 rows is a chain of products BLAS libraries are not shaped for: too few
rows to settle into their blocking, too many for the one-row streamed kernel (gemv.py). The
kernel here is the textbook one: the weight packed once into panels of 48 output columns
stored k-major, an 8 x 48 tile of y kept in 24 of AVX-512's 32 registers for the whole sum,
each panel kept in L2 while every tile of rows passes over it; bf16 on ``vdpbf16ps`` where the
CPU has AVX512-BF16. On the AVX-512 EPYC it ran SmolLM2's product chain 1.2-1.5x oneDNN's at
9-64 rows in fp32 and bf16, 1.04-1.18x at 128-512 (``profile_step --chains onednn,tiled``).
``linear_backend="tiled"`` is the gemv kernel for up to ``MAX_ROWS`` rows and this one above;
where it cannot run (no AVX-512, another dtype, no compiler) the engine says so in one line and
uses gemv's default.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .attention.cpp import load_extension
from .gemv import GemvLinear
from .quant import cpu_flags

_SOURCE = Path(__file__).with_name("csrc") / "tiled.cpp"
_state: dict = {}

# torch.ops.minillm.tiled_mm: declared here, computed by the C++ source once loaded. As an
# operator on plain tensors it is traceable: a compiled graph (rung 14) calls it inline.
torch.library.define("minillm::tiled_mm", "(Tensor x, Tensor panels, Tensor? bias, "
                     "Tensor? residual) -> Tensor")


@torch.library.register_fake("minillm::tiled_mm")
def _(x, panels, bias, residual):
    return x.new_empty(x.shape[0], panels.shape[0])


def load():
    """The built kernel module, or None (the reason in ``error()``)."""
    return load_extension(_SOURCE, _state, "the tiled product kernel", "the default kernel",
                          stem="minillm_tiled")


def error() -> str | None:
    return _state.get("error")


def dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes this CPU's build multiplies: fp32 with AVX-512, bf16 with AVX512-BF16 too."""
    module = load()
    if module is None or not module.has_tiles():
        return ()
    return (torch.float32, torch.bfloat16) if module.has_bf16() else (torch.float32,)


def why_not(device, dtype: torch.dtype) -> str | None:
    """None where ``tiled`` runs on ``device`` in ``dtype``, else the reason, in a few words."""
    if torch.device(device).type != "cpu":
        return f"it is a CPU kernel (device {torch.device(device).type})"
    module = load()
    if module is None:
        return f"it could not be built ({error()})"
    if not module.has_tiles():
        return "this CPU has no AVX-512"
    if dtype not in dtypes():
        return f"it takes {', '.join(map(str, dtypes()))} here, not {dtype}"
    return None


def preferred(device, dtype: torch.dtype) -> bool:
    """Whether ``tiled`` is the faster kernel here: where it runs, in fp32, and in bf16 on a CPU
    without AMX-BF16 (AMX's tile unit multiplies bf16 several times faster than AVX-512 can,
    and oneDNN uses it: docs/rungs/14_compiled.md, the Xeon)."""
    return why_not(device, dtype) is None and (dtype == torch.float32
                                               or "amx_bf16" not in cpu_flags())


class TiledLinear:
    """The tiled kernel on its packed panels: a tensor of the weight's shape, the values in the
    kernel's order (plain, so the compiled graph holds it as a buffer and calls
    ``minillm::tiled_mm`` inline)."""

    name = "tiled"
    traceable = True

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return load().pack(weight)

    def __call__(self, x, packed, bias=None, residual=None):
        return tiled(x, packed, bias, residual)


class GemvTiledLinear(GemvLinear):
    """``linear_backend="tiled"``: up to ``MAX_ROWS`` rows streamed by gemv (one row's product
    is the weight's bytes over the memory's speed: no tile helps), more in the tiles."""

    name = "tiled"

    def __init__(self):
        super().__init__(TiledLinear())


def tiled(x: torch.Tensor, panels: torch.Tensor, bias=None, residual=None) -> torch.Tensor:
    """``x @ W.T + bias + residual`` for x [..., in] on W's ``panels`` (``load().pack(W)``); the
    residual in x's dtype, y with x's leading dimensions."""
    flat = x.reshape(-1, x.shape[-1])
    res = None if residual is None else residual.reshape(flat.shape[0], panels.shape[0])
    y = torch.ops.minillm.tiled_mm(flat, panels, bias, res)
    return y.view(*x.shape[:-1], panels.shape[0])


__all__ = ["GemvTiledLinear", "TiledLinear", "dtypes", "error", "load", "preferred", "tiled",
           "why_not"]
