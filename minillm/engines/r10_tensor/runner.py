"""One tensor-parallel rank: its heads and MLP units of its stage's layers, and its KV heads of
every token (notebook 10).

Ranks form a grid: rank = stage x T + t. The T ranks of a stage run the same tokens at once,
each on its slice of every layer, and sum their row-parallel outputs with two all-reduces per
layer (``shard.py``); after the second one every rank of the stage holds the whole hidden
states, so rank t of a stage sends them to rank t of the next (rung 7's pipeline, one stage of
T ranks wide). The first stage's ranks each embed the token ids rank 0 sends them; the last
stage's rank t = 0 applies the head and sends the logits to rank 0, which samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ...layers.linear import get_linear_kernel
from ...core.model import PagedLlama
from ...dist.comm import CONNECT_TIMEOUT_S, Comm, process_group
from ..r7_pipeline.stage import StageConfig, StageRunner, StepInputs, serve, split_layers
from .shard import AllReduce, head_split, shard_model


@dataclass(frozen=True)
class TensorStageConfig(StageConfig):
    tensor_parallel_size: int = 1
    linear_backend: str | None = None     # every rank packs its own slices for this kernel
    all_reduce: str = "auto"              # how a stage sums its slices (shard.AllReduce)


class TensorStageRunner(StageRunner):
    """Rung 7's ``StageRunner`` on a sharded model; only where its input comes from and where
    its output goes differ."""

    def __init__(self, net: PagedLlama, rank: int, config: TensorStageConfig, backend, device,
                 dtype, all_reduce: AllReduce):
        """``net``: the whole model (its weights shared, not copied); this rank keeps its part."""
        self.whole, self.all_reduce = net, all_reduce    # what the workers take their parts of
        self.tp_size = T = config.tensor_parallel_size
        stage, t = divmod(rank, T)
        self.heads = head_split(net.num_heads, net.num_kv_heads, T, t)
        layers = range(*split_layers(len(net.layers), config.world_size // T)[stage])
        kernel = get_linear_kernel(config.linear_backend, device, dtype)
        super().__init__(shard_model(net, self.heads, layers, kernel, all_reduce), rank, config,
                         backend, device, dtype)

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def num_stages(self) -> int:
        return self.world_size // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def logits_rank(self) -> int:
        return (self.num_stages - 1) * self.tp_size

    def receive_input(self, comm: Comm, inputs: StepInputs) -> torch.Tensor:
        if self.stage == 0:           # every rank of the first stage embeds the token ids
            return comm.recv((inputs.num_tokens,), torch.long, 0, microbatch=inputs.microbatch)
        return comm.recv((inputs.num_tokens, self.hidden_size), self.dtype,
                         comm.rank - self.tp_size, microbatch=inputs.microbatch)

    def send_input(self, comm: Comm, ids: torch.Tensor, microbatch: int) -> None:
        for peer in range(1, self.tp_size):
            comm.isend(ids, peer)

    def send_output(self, comm: Comm, out: torch.Tensor) -> None:
        if not self.is_last:
            comm.isend(out, comm.rank + self.tp_size)
        elif self.computes_logits and out.shape[0] and comm.rank != 0:
            comm.isend(out, 0)


def connect_stage(all_reduce: AllReduce, comm: Comm, tensor_parallel_size: int) -> None:
    """Connect this rank's all-reduce to its stage's T ranks; every rank of the stage calls this
    (the collective forms the stage's own process group, on the whole group's store)."""
    stage, t = divmod(comm.rank, tensor_parallel_size)
    peers = range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size)
    pg = None
    if all_reduce.how != "exchange":
        store = dist.PrefixStore(f"minillm-tensor-stage{stage}", comm.store)
        timeout = timedelta(seconds=max(comm.timeout_s, CONNECT_TIMEOUT_S))
        pg = process_group(store, t, tensor_parallel_size, comm.device, timeout)
    all_reduce.connect(comm, peers, pg)


def run_tensor_worker(comm: Comm, net: PagedLlama) -> None:
    """Ranks 1..: learn the layout from rank 0, join the stage's group, build the shard, serve
    micro-batches with rung 7's loop."""
    from .. import get_attention_backend

    config: TensorStageConfig = comm.recv_object(0, what=None)
    all_reduce = AllReduce(config.all_reduce)
    connect_stage(all_reduce, comm, config.tensor_parallel_size)
    backend = get_attention_backend(config.attention_backend, comm.device, net.embed.dtype)
    runner = TensorStageRunner(net, comm.rank, config, backend, comm.device, net.embed.dtype,
                               all_reduce)
    serve(comm, runner)
    comm.close()
