"""``TritonAttention``: rung 4's kernels behind the attention-backend interface of rung 3.

A drop-in replacement for ``TorchAttention`` (``core/attention/reference.py``): same three methods,
same arguments, so ``paged_attention(backend, ...)`` and the paged engine need no change.
"""
from __future__ import annotations

import torch

# Importing this module runs the package's __init__ first, which sets TRITON_INTERPRET on a
# machine without CUDA before ``kernels`` imports triton.
from ..reference import AttentionMetadata
from . import kernels


class TritonAttention:
    """Paged attention that reads the KV pools in place through the block tables."""

    name = "triton"

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter this step's new K/V rows [T, kv_heads, head_dim] into their slots."""
        kernels.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] -> [B, H, D]; sequence b attends to its first context_lens[b] tokens."""
        return kernels.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)

    def extend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """q [T, H, D] (all prefill chunks, flat) -> [T, H, D].

        ``k_new``/``v_new`` are not needed: ``write_kv`` has already put them in the cache, and
        the kernel reads prefix and new tokens alike through the block table.
        """
        max_q_len = max(meta.prefill_q_lens) if meta.prefill_q_lens else None
        return kernels.paged_extend(q, k_cache, v_cache, meta.prefill_block_tables,
                                    meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale,
                                    max_q_len=max_q_len)
