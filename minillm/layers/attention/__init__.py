"""Attention backends of the paged engine (rungs 3 and 4, notebook 04): one interface, three
implementations that must give the same numbers.

* ``reference.py`` -- ``TorchAttention``: write K/V into the block pool, read it back through the
  block tables with plain torch (rung 3; lab exercise 04).
* ``cpp.py`` + ``csrc/`` -- the decode read as a C++ kernel for the CPU (rung 4).
* ``triton/`` -- Triton kernels for the GPU (rung 4).

The engine never imports a kernel: ``get_attention_backend`` picks one by name and device.
"""
from __future__ import annotations

def get_attention_backend(name: str | None, device, dtype=None):
    """``torch`` (rung 3's reference), ``cpp`` (rung 3's decode as a C++ kernel for the CPU) or
    ``triton`` (rung 4). By default: triton on CUDA when it is installed (else torch); on the CPU
    cpp when it builds (a C++ compiler is there), else torch. Asking for triton where it cannot run
    raises ``TritonUnavailableError`` saying what to install.

    A float64 model (the exactness tests' references) runs on torch on CUDA: compiled Triton
    kernels accumulate in fp32 and refuse a float64 loop (its interpreter on a CPU does not)."""
    import torch
    fp64_on_gpu = device.type == "cuda" and dtype == torch.float64
    if name == "triton" and fp64_on_gpu:
        raise ValueError("attention_backend='triton' compiles fp32/fp16/bf16 kernels, not "
                         "torch.float64 on cuda: use attention_backend='torch'")
    if name is None:
        from .triton import triton_available
        if device.type == "cuda":
            name = "triton" if triton_available() and not fp64_on_gpu else "torch"
        else:
            from .cpp import cpp_available
            name = "cpp" if cpp_available() else "torch"
    if name == "torch":
        from .reference import TorchAttention
        return TorchAttention()
    if name == "cpp":
        from .cpp import CppAttention
        return CppAttention()
    if name == "triton":
        from .triton import TritonAttention  # sets TRITON_INTERPRET=1 on CPU first
        return TritonAttention()
    raise ValueError(f"unknown attention_backend {name!r}: choose 'torch', 'cpp' or 'triton'")
