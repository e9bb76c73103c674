"""A decoder layer's elementwise work -- RMSNorm, RoPE, SiLU-times-up -- as one pass each on the
CPU (``csrc/fused_ops.cpp``; notebook 04 times it).

At 1-128 decode rows a layer's activations are a few hundred KB: eager torch's RMSNorm (five
passes), RoPE (six) and SiLU-times-up (three) cost their dispatches and thread fork/joins, not
their bytes -- a tenth to a fifth of a step (``make profile``: "other forward"). ``EagerOps`` is
the reference. ``FusedOps`` computes the same in fp32 and, for bf16/fp16, rounds once (twice for
RMSNorm, where Hugging Face does). An fp32 model differs from eager torch only in the order of
the additions (a few units of fp32's last place, as oneDNN's products do); its tokens are still
checked against Hugging Face's. The ops load like the attention kernel (built once, or the eager
ops with one warning saying why).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .attention.cpp import load_extension

_SOURCE = Path(__file__).with_name("csrc") / "fused_ops.cpp"
_state: dict = {}


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's halves by the position's angle (x: [T, heads, D], cos/sin: [T, D])."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class EagerOps:
    """The layer's elementwise steps in plain torch (the reference)."""

    name = "eager"

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * w, in fp32 like HF (narrowed before the weight)."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * w

    @staticmethod
    def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] of ``qkv``, each head's halves rotated by its position's
        angle (cos/sin: [T, D]). q and k sit side by side in qkv: rotated in one go."""
        d = cos.shape[-1]
        qk = rope_heads(qkv[:, :(heads + kv_heads) * d].view(-1, heads + kv_heads, d), cos, sin)
        return qk[:, :heads], qk[:, heads:]

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedOps(EagerOps):
    """The same steps, one C++ loop each, for fp32/bf16/fp16 rows on the CPU."""

    name = "fused"

    def __init__(self, module):
        self.module = module

    def __reduce__(self):
        # A pipeline or tensor-parallel worker gets the model by pickle: the extension module
        # does not pickle, so the worker loads its own (the same cached build) or the eager ops.
        return (_for_16_bit, ())

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self.module.rms_norm(x.contiguous(), w, eps)

    def rope(self, qkv, cos, sin, heads, kv_heads):
        q, k = self.module.rope(qkv.contiguous(), cos, sin, heads, kv_heads)
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.module.silu_mul(gate_up.contiguous())


def layer_ops(dtype: torch.dtype, device: torch.device, name: str | None = None) -> EagerOps:
    """The ops ``name`` asks for (``ModelConfig.layer_ops``); by default ``FusedOps`` for an
    fp32/bf16/fp16 model on the CPU where the extension builds, else ``EagerOps``."""
    if name == "eager":
        return EagerOps()
    fits = device.type == "cpu" and dtype in (torch.bfloat16, torch.float16, torch.float32)
    if name == "fused" and not fits:
        raise ValueError(f"layer_ops='fused' computes fp32/bf16/fp16 on the CPU, not {dtype} on "
                         f"{device.type}: use 'eager'")
    ops = _for_16_bit() if fits else EagerOps()
    if name == "fused" and not isinstance(ops, FusedOps):
        raise ValueError(f"layer_ops='fused': the extension could not be built "
                         f"({_state.get('error')})")
    return ops


def _for_16_bit() -> EagerOps:
    module = load_extension(_SOURCE, _state, "the fused layer ops", "the eager torch ops",
                            stem="minillm_fused_ops")
    return FusedOps(module) if module is not None else EagerOps()
