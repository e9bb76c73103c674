"""``TritonAttention``: rung 4's kernels behind the attention-backend interface of rung 3.

A drop-in replacement for ``TorchAttention`` (``layers/attention/reference.py``): same three methods,
same arguments, so ``paged_attention(backend, ...)`` and the paged engine need no change. A pool may
also be rung 9's ``QuantizedPool``: its stored rows and scales go to the kernels as two tensors,
and the kernels quantize as they write and widen as they read (no dequantized copy, ever).
"""
from __future__ import annotations

import torch

from ...kv_quant import QuantizedPool
# Importing this module runs the package's __init__ first, which sets TRITON_INTERPRET on a
# machine without CUDA before ``kernels`` imports triton.
from ..reference import AttentionMetadata
from . import kernels


def _unpack(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(k rows, v rows, their scales as keyword arguments): a plain pool is its own rows."""
    if isinstance(k_cache, QuantizedPool):
        return k_cache.data, v_cache.data, {"k_scale": k_cache.scale, "v_scale": v_cache.scale}
    return k_cache, v_cache, {}


class TritonAttention:
    """Paged attention that reads the KV pools in place through the block tables."""

    name = "triton"

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter this step's new K/V rows [T, kv_heads, head_dim] into their slots."""
        k_rows, v_rows, scales = _unpack(k_cache, v_cache)
        kernels.store_kv(k, v, k_rows, v_rows, slot_mapping, **scales)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] -> [B, H, D]; sequence b attends to its first context_lens[b] tokens."""
        k_rows, v_rows, scales = _unpack(k_cache, v_cache)
        return kernels.paged_decode(q, k_rows, v_rows, block_tables, context_lens, scale,
                                    **scales)

    def extend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """q [T, H, D] (all prefill chunks, flat) -> [T, H, D].

        ``k_new``/``v_new`` are not needed: ``write_kv`` has already put them in the cache, and
        the kernel reads prefix and new tokens alike through the block table (from a narrow pool,
        as stored: a fresh prompt attends to its own K/V quantized, like every later token).
        """
        k_rows, v_rows, scales = _unpack(k_cache, v_cache)
        max_q_len = max(meta.prefill_q_lens) if meta.prefill_q_lens else None
        return kernels.paged_extend(q, k_rows, v_rows, meta.prefill_block_tables,
                                    meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale,
                                    max_q_len=max_q_len, **scales)
