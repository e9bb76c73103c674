"""``KVPool``: the memory the paged KV cache lives in, allocated here only (notebook 03).

One K tensor and one V tensor per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A block id means the same rows in every one of them: the ``BlockManager`` hands out ids, the
runner writes and reads the rows (through the slot mapping and block tables). With a narrower
``kv_cache_dtype`` (rung 9, kv_quant.py) each pool is a ``QuantizedPool``: the same rows, stored
in 16 bits, int8 or fp8, and a scale per row that moves with its block. Every runner owns
one pool for the layers it runs: the whole model (rung 3), the draft's first layers (rung 6's
draft proposer) or one pipeline stage's slice (rung 7).
"""
from __future__ import annotations

import torch

from ..layers.kv_quant import FORMATS, KVCacheFormat, make_pool, pool_tensors


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 fmt: KVCacheFormat = FORMATS["auto"]):
        """``dtype``: the model's (what attention computes in); ``fmt``: how rows are stored."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device, self.fmt = dtype, torch.device(device), fmt
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # (k, v) per layer, in layer order: what PagedLlama.forward_layers reads and writes.
        self.caches = [(make_pool(shape, fmt, dtype, self.device),
                        make_pool(shape, fmt, dtype, self.device)) for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def num_bytes(self) -> int:
        """What the pool really holds, measured on its tensors. For the whole model it equals
        ``num_blocks * block_size * LoadedModel.kv_bytes_per_token`` (the engine's unit)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool holds (a narrow pool's scales included), each indexed by block."""
        return [t for kv in self.caches for pool in kv for t in pool_tensors(pool)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: ``(src, dst)`` block pairs, every layer's K and V rows of ``src`` copied
        into ``dst`` (a sequence gets its own copy of a block it shared before writing into it).
        The stored bytes are copied as they are, scales with them: never requantized."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for t in self.tensors():
            t[dst] = t[src]

    # --- a KV transfer between two pools of the same layout (rung 11: prefill -> decode) ----------
    def read_blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """A copy of ``blocks``' rows in every tensor of the pool (``tensors()`` order, scales
        included): what a transfer sends, as stored — never widened or requantized."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return [t[idx] for t in self.tensors()]

    def write_blocks(self, blocks: list[int], data: list[torch.Tensor]) -> None:
        """Write ``read_blocks``' output (from a pool of the same layout) into ``blocks``."""
        mine = self.tensors()
        if len(data) != len(mine) or any(d.shape[1:] != t.shape[1:] or d.dtype != t.dtype or
                                         d.shape[0] != len(blocks) for d, t in zip(data, mine)):
            raise ValueError("write_blocks: the data's layout is not this pool's (tensors "
                             f"{[(tuple(d.shape), d.dtype) for d in data][:2]}..., blocks "
                             f"{len(blocks)})")
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for t, d in zip(mine, data):
            t[idx] = d.to(t.device)
