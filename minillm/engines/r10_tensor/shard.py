"""How one layer's weights split across ``world`` tensor-parallel ranks (Megatron's split).

Heads are the unit: rank r computes query heads ``[r·H/T, (r+1)·H/T)`` and the KV heads they read.
When T divides the KV heads each rank holds its own ``KVH/T`` of them; when T is a multiple of KVH
(more ranks than KV heads) each KV head is *replicated* on the ``T/KVH`` ranks whose query heads
read it, as vLLM does; anything else is an error naming both numbers. The MLP splits its
intermediate units evenly. Embeddings, norms and the vocabulary projection stay whole on every
rank: replicating the head costs 28 M parameters on SmolLM2 but saves an all-gather of logits per
step, and rank 0 alone samples.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.linear import Linear
from ...core.model import LayerWeights


@dataclass(frozen=True)
class HeadSplit:
    """Which heads one rank computes."""

    rank: int
    world: int
    q_heads: range               # this rank's query heads (global indices)
    kv_heads: range              # the KV heads they read
    kv_replicas: int = 1         # ranks holding each of those KV heads (T / KVH when T > KVH)


def head_split(num_heads: int, num_kv_heads: int, world: int, rank: int) -> HeadSplit:
    """Rank ``rank``'s heads out of ``num_heads`` query and ``num_kv_heads`` KV heads."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of tensor_parallel_size={world} ranks")
    if num_heads % world:
        raise ValueError(f"tensor_parallel_size={world} must divide the model's {num_heads} "
                         f"attention heads")
    per_rank = num_heads // world
    q = range(rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads % world == 0:
        kv_per_rank, replicas = num_kv_heads // world, 1
        kv = range(rank * kv_per_rank, (rank + 1) * kv_per_rank)
    elif world % num_kv_heads == 0:          # more ranks than KV heads: replicate (vLLM)
        replicas = world // num_kv_heads
        kv = range(rank // replicas, rank // replicas + 1)
    else:
        raise ValueError(f"tensor_parallel_size={world} and the model's {num_kv_heads} KV heads: "
                         "one must divide the other")
    return HeadSplit(rank, world, q, kv, replicas)


def _rows(w: torch.Tensor, heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    return w[offset + heads.start * head_dim: offset + heads.stop * head_dim]


def shard_layer(w: LayerWeights, split: HeadSplit, num_heads: int, num_kv_heads: int,
                head_dim: int, kernel) -> LayerWeights:
    """This rank's ``LayerWeights``: column-parallel q/k/v (its heads) and gate/up (its units),
    row-parallel o and down (the matching input columns). Summing the row-parallel outputs of all
    ranks (the all-reduce) gives the whole layer's."""
    q_off, k_off, v_off = 0, num_heads * head_dim, (num_heads + num_kv_heads) * head_dim

    def qkv_part(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([_rows(t, split.q_heads, head_dim, q_off),
                          _rows(t, split.kv_heads, head_dim, k_off),
                          _rows(t, split.kv_heads, head_dim, v_off)])

    inter = w.gate_up.weight.shape[0] // 2
    if inter % split.world:
        raise ValueError(f"tensor_parallel_size={split.world} must divide the MLP's {inter} "
                         "intermediate units")
    n = inter // split.world
    units = slice(split.rank * n, (split.rank + 1) * n)
    gate, up = w.gate_up.weight[:inter], w.gate_up.weight[inter:]
    cols = slice(split.q_heads.start * head_dim, split.q_heads.stop * head_dim)
    bias = w.qkv.bias
    return LayerWeights(
        input_norm=w.input_norm,
        qkv=Linear(qkv_part(w.qkv.weight), None if bias is None else qkv_part(bias), kernel),
        o=Linear(w.o.weight[:, cols].contiguous(), None, kernel),
        post_norm=w.post_norm,
        gate_up=Linear(torch.cat([gate[units], up[units]]), None, kernel),
        down=Linear(w.down.weight[:, units].contiguous(), None, kernel))
