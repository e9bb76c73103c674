"""Which kernels run the model: the attention backend (rung 3's torch reference, rung 4's C++ and
Triton kernels), the linear layers' kernel and a layer's elementwise ops (``ModelConfig``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime.config import option

ATTENTION_BACKENDS = ("torch", "cpp", "triton")
LINEAR_BACKENDS = ("torch", "onednn", "gemv", "tiled")
LAYER_OPS = ("fused", "eager")
QUANTIZATIONS = ("int8", "w8a8")     # rung 14's weight formats (layers/quant.py)


@dataclass(frozen=True)
class ModelConfig:
    """How the model runs: the attention backend (rung 3's torch reference, rung 4's kernels),
    the kernel of the linear layers (layers/linear.py) and their weights' format (rung 14's
    ``quantization``, layers/quant.py)."""

    attention_backend: str | None = option(
        None, "paged: attention backend, torch, cpp or triton (default: triton on CUDA, cpp on "
              "CPU where a C++ compiler builds it, else torch)", aliases=("--attention",))
    linear_backend: str | None = option(
        None, "paged: linear-layer kernel, torch (F.linear), onednn (weights reordered once; "
              "default for fp32 on the CPU where it works, else torch), gemv (rung 14: up to "
              "8 fp32 rows streamed by layers/gemv.py, more rows by the default) or tiled "
              "(rung 14: gemv up to 8 rows, more in register tiles, layers/tiled.py; AVX-512, "
              "fp32 or bf16)")
    layer_ops: str | None = option(
        None, "paged: a layer's RMSNorm, RoPE and SiLU, fused (one C++ pass each: the default for "
              "fp32/bf16/fp16 on the CPU where it builds) or eager (torch ops: the reference)")
    quantization: str | None = option(
        None, "paged: linear weights in int8, one scale per output channel: int8 (weight-only) "
              "or w8a8 (activations in int8 per token too; needs VNNI or AMX-INT8); it picks "
              "the linear kernel (layers/quant.py, rung 14)")

    def __post_init__(self):
        if self.layer_ops not in (None, *LAYER_OPS):
            raise ValueError(f"unknown layer_ops {self.layer_ops!r}: choose "
                             f"{' or '.join(map(repr, LAYER_OPS))}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"unknown quantization {self.quantization!r}: choose "
                             f"{' or '.join(map(repr, QUANTIZATIONS))}")
        if self.quantization is not None:
            # the quantized weight is the kernel's own format: the kernel is named after it, and
            # the engine reads it where it reads any linear kernel's name (linear_backend)
            if self.linear_backend not in (None, self.quantization):
                raise ValueError(f"quantization={self.quantization!r} picks the linear kernel "
                                 f"itself: leave linear_backend unset (got "
                                 f"{self.linear_backend!r})")
            object.__setattr__(self, "linear_backend", self.quantization)
        elif self.linear_backend not in (None, *LINEAR_BACKENDS):
            raise ValueError(f"unknown linear_backend {self.linear_backend!r}: choose "
                             f"{' or '.join(map(repr, LINEAR_BACKENDS))}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}: choose "
                             f"{', '.join(map(repr, ATTENTION_BACKENDS[:-1]))} or "
                             f"{ATTENTION_BACKENDS[-1]!r}")


__all__ = ["ATTENTION_BACKENDS", "LAYER_OPS", "LINEAR_BACKENDS", "ModelConfig", "QUANTIZATIONS"]
