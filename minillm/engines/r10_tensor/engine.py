"""Rung 10's engine: rung 7's pipeline, each stage T ranks wide (notebook 10).

Everything rank 0 does is rung 7's (and so rung 3's): one scheduler, one block manager, a step's
metadata sent to every rank, logits back, the sampler, the commit. What this rung adds is the
runner each rank builds (``runner.py``: its shard of the layers, two all-reduces per layer) and
where token ids and hidden states travel. With one stage (``pipeline_parallel_size=1``, the
default) and one micro-batch in flight (the default: one per stage) every step is rung 3's step
computed by T ranks at once, so the tokens are the single-process engine's.

KV memory: the block manager is the whole model's (``kv_cache_bytes`` buys the blocks it would
buy in one process); each rank's pool holds its KV heads of its stage's layers for every block,
so a block costs each rank 1/T of it (more where KV heads are replicated).
"""
from __future__ import annotations

import sys

from ...core.engine import PagedEngine
from ...layers.linear import TorchLinear
from ...core.model import PagedLlama
from ...dist.comm import WorkerError, group_from_env
from ..r7_pipeline.engine import PipelineEngine
from ...dist.launcher import WorkerGroup, launch, torchrun_device
from ..r7_pipeline.stage import split_layers
from .config import TensorParallelConfig
from .runner import TensorStageConfig, TensorStageRunner, connect_stage, run_tensor_worker
from .shard import AllReduce, head_split


class TensorParallelEngine(PipelineEngine):
    name = "tensor"

    configs = PagedEngine.configs + (TensorParallelConfig,)

    @property
    def world_size(self) -> int:
        return self.parallel_config.world_size

    @property
    def world_size_name(self) -> str:
        c = self.parallel_config
        return (f"tensor_parallel_size={c.tensor_parallel_size} x pipeline_parallel_size="
                f"{c.pipeline_parallel_size} = {self.world_size} ranks")

    def make_runner(self, num_blocks: int, block_size: int, backend) -> TensorStageRunner:
        c = self.parallel_config
        config = TensorStageConfig(
            self.world_size, num_blocks, block_size, self.model_config.attention_backend,
            self.cache_config.kv_cache_dtype, c.tensor_parallel_size,
            self.model_config.linear_backend, c.all_reduce)
        # The whole model, for the workers to take their parts of (shared memory, no copy):
        # TorchLinear packs nothing, each rank packs its own slices for the chosen kernel.
        whole = PagedLlama(self.model.hf_model, TorchLinear(), self.layer_ops())
        return TensorStageRunner(whole, 0, config,
                                 backend, self.model.device, self.model.dtype,
                                 AllReduce(c.all_reduce))

    def launch_workers(self, world: int, timeout_s: float, threads: int) -> WorkerGroup:
        return launch(self.runner.whole, world, timeout_s, threads, run=run_tensor_worker,
                      role="tensor-parallel")

    def connect(self) -> None:
        super().connect()
        connect_stage(self.runner.all_reduce, self.comm,
                      self.parallel_config.tensor_parallel_size)

    def kv_bytes_per_rank(self) -> list[int]:
        """Bytes of KV cache each rank holds for one token: its KV heads of its stage's layers
        (rank 0's pool is here; the others' follow from the same split)."""
        c, net = self.parallel_config, self.runner.whole
        T, P = c.tensor_parallel_size, c.pipeline_parallel_size
        per_head_layer = self.kv_bytes_per_token // (len(net.layers) * net.num_kv_heads)
        out = []
        for rank in range(self.world_size):
            stage, t = divmod(rank, T)
            start, end = split_layers(len(net.layers), P)[stage]
            heads = len(head_split(net.num_heads, net.num_kv_heads, T, t).kv_heads)
            out.append(per_head_layer * heads * (end - start))
        return out


def torchrun_worker(model_name: str, pipeline_timeout_s: float = 60.0,
                    dtype: str | None = None, **rank0_options) -> int:
    """What ``python -m minillm generate --tensor-parallel T`` runs on ranks 1.. under torchrun:
    load the same model, join the group, serve until rank 0 says "stop"."""
    from ...models import load_model

    device = torchrun_device()
    model = load_model(model_name, device, dtype)     # rank 0's --dtype
    comm = group_from_env(device, pipeline_timeout_s)
    try:
        run_tensor_worker(comm, PagedLlama(model.hf_model, TorchLinear()))
    except WorkerError as e:
        print(f"[minillm tensor] {e}", file=sys.stderr)
        return 1
    return 0
