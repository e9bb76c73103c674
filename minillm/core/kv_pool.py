"""``KVPool``: the memory the paged KV cache lives in, allocated here only (notebook 03).

One K tensor and one V tensor per layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A block id means the same rows in every one of them: the ``BlockManager`` hands out ids, the
runner writes and reads the rows (through the slot mapping and block tables). Every runner owns
one pool for the layers it runs: the whole model (rung 3), the draft's first layers (rung 6's
draft proposer) or one pipeline stage's slice (rung 7).
"""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # (k, v) per layer, in layer order: what PagedLlama.forward_layers reads and writes.
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=self.device),
             torch.zeros(shape, dtype=dtype, device=self.device)) for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def num_bytes(self) -> int:
        """What the pool really holds, measured on its tensors. For the whole model it equals
        ``num_blocks * block_size * LoadedModel.kv_bytes_per_token`` (the engine's unit)."""
        return sum(t.numel() * t.element_size() for kv in self.caches for t in kv)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: ``(src, dst)`` block pairs, every layer's K and V rows of ``src`` copied
        into ``dst`` (a sequence gets its own copy of a block it shared before writing into it)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.caches:
            k[dst], v[dst] = k[src], v[src]
