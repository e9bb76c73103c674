"""``TensorParallelConfig``: rung 10's ranks — T per stage, P stages (vLLM's ``parallel_config``
with both sizes). ``paged`` with ``tensor_parallel_size`` (``--tensor-parallel T``) is this
engine; ``--pipeline-parallel P`` beside it runs T x P ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime.config import option, set_checked
from ..r7_pipeline.config import ParallelConfig
from .shard import ALL_REDUCES


@dataclass(frozen=True)
class TensorParallelConfig(ParallelConfig):
    pipeline_parallel_size: int = option(1, "with tensor parallelism: pipeline stages of T ranks "
                                            "each (default 1)", aliases=("--pipeline-parallel",))
    tensor_parallel_size: int = option(2, "tensor parallelism: ranks every layer is split "
                                          "across (with --engine paged it selects the "
                                          "tensor-parallel engine)",
                                       aliases=("--tensor-parallel",))

    all_reduce: str = option("auto", "tensor parallelism: how a stage sums its slices: "
                                     "'collective' (the process group's all-reduce: NCCL, gloo), "
                                     "'exchange' (point-to-point, summed in rank order), 'auto' "
                                     "(exchange on CPU for tensors up to 1 MiB, collective "
                                     "otherwise)")

    def __post_init__(self):
        if self.all_reduce not in ALL_REDUCES:
            raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got "
                             f"{self.all_reduce!r}")
        set_checked(self, "pipeline_parallel_size")
        set_checked(self, "tensor_parallel_size")
        set_checked(self, "num_microbatches", optional=True)
        set_checked(self, "worker_threads")
        set_checked(self, "pipeline_timeout_s")
        if self.world_size < 2:
            raise ValueError("tensor_parallel_size x pipeline_parallel_size must be at least 2 "
                             "ranks (one rank is the paged engine)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
