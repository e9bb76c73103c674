"""A random paged KV cache for the kernel benchmarks (``kernels.py`` on a GPU,
``cpu_attention.py`` on the CPU): sequences in shuffled blocks of one pool, and the same K/V laid
out contiguously (what a non-paged cache would hold)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..layers.attention.reference import TorchAttention


@dataclass
class Paged:
    """A random paged KV cache: every sequence of ``lens`` in shuffled blocks of one pool."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor         # [B, max_blocks] int32, -1 past each sequence's blocks
    context_lens: torch.Tensor   # [B] int32


def make_paged(lens: list[int], block_size: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype, device: str) -> Paged:
    nblocks = [math.ceil(n / block_size) for n in lens]
    pool = sum(nblocks) + 4
    shape = (pool, block_size, kv_heads, head_dim)
    physical = torch.randperm(pool)
    tables = torch.full((len(lens), max(nblocks)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(nblocks):
        tables[b, :n] = physical[start:start + n]
        start += n
    return Paged(torch.randn(shape, dtype=dtype, device=device),
                 torch.randn(shape, dtype=dtype, device=device), tables.to(device),
                 torch.tensor(lens, dtype=torch.int32, device=device))


def contiguous_kv(p: Paged, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V as [B, kv_heads, ctx, D] contiguous tensors, for the plain-SDPA baseline."""
    k = TorchAttention.gather(p.k_cache, p.tables, ctx).transpose(1, 2).contiguous()
    v = TorchAttention.gather(p.v_cache, p.tables, ctx).transpose(1, 2).contiguous()
    return k, v
