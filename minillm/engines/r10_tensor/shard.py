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

from dataclasses import dataclass, replace

import torch

from ...layers.linear import Linear
from ...core.model import LayerWeights, PagedLlama


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


ALL_REDUCES = ("auto", "collective", "exchange")
TAG_REDUCE = 2     # rung 7's messages use tags 0 and 1: slices never mix with them
# Measured crossover on the lab CPU (traffic.measure_all_reduce, 2 and 3 ranks): the exchange was
# faster at 288 KB, slower at 2.3 MB.
EXCHANGE_MAX_BYTES = 1 << 20


class AllReduce:
    """Sum a tensor over the T ranks of one stage. Two ways (``all_reduce=``):

    * ``collective``: the stage group's all-reduce (NCCL on GPUs; gloo on CPUs);
    * ``exchange``: every rank sends its slice to the T - 1 others (rung 7's point-to-point
      messages) and adds the T slices in rank order -- the same order on every rank, so every
      rank gets the same bits.

    On this CPU a gloo all-reduce of a decode step's tensor (tens of KB) took 4-8x longer than the
    exchange; from a few MB on, the exchange's copies make it the slower one (``traffic.py``
    measures both). CPU engines (vLLM's, DeepSpeed's) bring their own all-reduce for the same
    reason. ``auto``: the exchange on CPU up to ``EXCHANGE_MAX_BYTES``, the collective otherwise
    (always on CUDA, where NCCL is the fast one).

    Each call is an ``all_reduce`` span on the rank's timeline (inside its ``compute`` span).
    Rank 0 builds its runner before the group exists, so the group is ``connect``ed after."""

    def __init__(self, how: str = "auto"):
        if how not in ALL_REDUCES:
            raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {how!r}")
        self.how, self.pg, self.comm, self.peers = how, None, None, range(0)

    def connect(self, comm, peers: range, pg=None) -> None:
        """``peers``: the global ranks of this rank's stage; ``pg``: its group (for the
        collective; not needed when ``how`` is exchange)."""
        self.comm, self.peers, self.pg = comm, peers, pg

    def exchanges(self, y: torch.Tensor) -> bool:
        if self.how == "auto":
            return self.comm.device.type != "cuda" and \
                y.numel() * y.element_size() <= EXCHANGE_MAX_BYTES
        return self.how == "exchange"

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            raise RuntimeError("this rank's all-reduce group is not connected yet")
        with self.comm.timeline.span("all_reduce"):
            if self.exchanges(y):
                return self._exchange(y)
            self.comm.wait(self.pg.allreduce([y]), None)
            return y

    def _exchange(self, y: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        for peer in self.peers:
            if peer != comm.rank:
                comm.isend(y, peer, TAG_REDUCE)
        total = None
        for peer in self.peers:
            part = y if peer == comm.rank else comm.recv(y.shape, y.dtype, peer, TAG_REDUCE,
                                                         what=None)
            total = part.clone() if total is None else total.add_(part)
        return total


class RowParallelLinear(Linear):
    """A row-parallel projection (o, down): this rank's slice of the product, then the all-reduce
    that sums the T slices. Rank 0's slice carries the residual, so the sum adds it once."""

    def __init__(self, weight: torch.Tensor, kernel, all_reduce, adds_residual: bool):
        super().__init__(weight, None, kernel)
        self.all_reduce, self.adds_residual = all_reduce, adds_residual

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = self.kernel(x.contiguous(), self.packed, None,
                        residual if self.adds_residual else None)
        return self.all_reduce(y.contiguous())


def shard_model(net: PagedLlama, split: HeadSplit, layers: range, kernel,
                all_reduce: AllReduce) -> PagedLlama:
    """This rank's model: the layers ``layers`` (its pipeline stage's) split for ``split``, with
    the all-reduce after o and down; the core's ``forward_layers`` then runs it unchanged. The
    other stages' layers stay whole and unread (``forward_layers`` runs ``layers`` only)."""
    H, KVH, D = net.num_heads, net.num_kv_heads, net.head_dim
    mine = []
    for i, w in enumerate(net.layers):
        if i in layers:
            part = shard_layer(w, split, H, KVH, D, kernel)
            first = split.rank == 0          # the rank whose slice carries the residual
            w = replace(part, o=RowParallelLinear(part.o.weight, kernel, all_reduce, first),
                        down=RowParallelLinear(part.down.weight, kernel, all_reduce, first))
        mine.append(w)
    return net.with_layers(mine, len(split.q_heads), len(split.kv_heads))
