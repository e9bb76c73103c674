"""``ParallelConfig``: how rung 7 cuts the model across processes (vLLM's ``parallel_config``,
reduced to pipeline parallelism). Its fields are engine options (``minillm.core.config``):
``paged`` with ``pipeline_parallel_size`` (``--pipeline-parallel N``) is the pipeline engine.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime.config import option, set_checked


@dataclass(frozen=True)
class ParallelConfig:
    pipeline_parallel_size: int = option(2, "pipeline: number of stages (processes), >= 2 "
                                            "(with --engine paged it selects the pipeline "
                                            "engine)", aliases=("--pipeline-parallel",))
    num_microbatches: int | None = option(None, "pipeline: micro-batches in flight (default: "
                                                "one per stage)")
    worker_threads: int = option(1, "pipeline: torch threads per spawned worker")
    pipeline_timeout_s: int = option(60, "pipeline: seconds any wait on another rank may take "
                                         "before it is an error")

    def __post_init__(self):
        set_checked(self, "pipeline_parallel_size", 2)
        set_checked(self, "num_microbatches", optional=True)
        set_checked(self, "worker_threads")
        set_checked(self, "pipeline_timeout_s")
