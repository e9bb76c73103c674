"""Paged K/V test data shared by the kernel tests (Triton: test_triton_kernels.py, C++:
test_cpu_kernel.py): random sequences scattered into shuffled blocks, NaN wherever no sequence
lives, and textbook attention to compare with."""
from __future__ import annotations

import torch

HEAD_DIM = 16
SCALE = HEAD_DIM ** -0.5
NAN = float("nan")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the reference's max abs value (NaN anywhere -> inf)."""
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


class PagedKV:
    """Random per-sequence K/V, both dense and scattered into shuffled blocks of a pool."""

    def __init__(self, lens: list[int], block_size: int, num_kv_heads: int, extra_cols: int = 1,
                 head_dim: int = HEAD_DIM):
        self.lens, self.block_size = lens, block_size
        nblocks = [(n + block_size - 1) // block_size for n in lens]
        pool_blocks = 2 * sum(nblocks) + 3                      # more blocks than needed
        physical = torch.randperm(pool_blocks).tolist()        # scattered, shuffled
        width = max(nblocks) + extra_cols                      # trailing entries stay -1
        self.tables = torch.full((len(lens), width), -1, dtype=torch.int32)
        shape = (pool_blocks, block_size, num_kv_heads, head_dim)
        self.k_ref, self.v_ref = torch.randn(shape), torch.randn(shape)   # clean: reference
        self.k_nan, self.v_nan = torch.full(shape, NAN), torch.full(shape, NAN)  # kernels
        self.k_dense, self.v_dense, self.slots = [], [], []
        for s, n in enumerate(lens):
            blocks = [physical.pop() for _ in range(nblocks[s])]
            self.tables[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            pos = torch.arange(n)
            slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
            k, v = torch.randn(n, num_kv_heads, head_dim), torch.randn(n, num_kv_heads, head_dim)
            for pool, x in ((self.k_ref, k), (self.v_ref, v), (self.k_nan, k), (self.v_nan, v)):
                pool.view(-1, num_kv_heads, head_dim)[slots] = x
            self.k_dense.append(k)
            self.v_dense.append(v)
            self.slots.append(slots)
        self.context_lens = torch.tensor(lens, dtype=torch.int32)

    def to(self, device: str) -> "PagedKV":
        for name in ("tables", "k_ref", "v_ref", "k_nan", "v_nan", "context_lens"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int]
                    ) -> torch.Tensor:
    """Textbook attention, one query at a time: q [n, H, D] at ``positions``; k, v [L, kvh, D]."""
    H, kvh = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        for h in range(H):
            kv = h // (H // kvh)                                  # GQA: the head's KV head
            scores = k[:p + 1, kv].double() @ q[i, h].double() * SCALE
            out[i, h] = torch.softmax(scores, dim=0) @ v[:p + 1, kv].double()
    return out


def decode_lens(bs: int) -> list[int]:
    # 1 token, exactly one and two blocks, one past a block boundary, and a longer one (6 blocks)
    return [1, bs, bs + 1, 2 * bs, 5 * bs + 3]
