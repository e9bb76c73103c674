"""Rung 14's engine: rung 3's engine with a runner whose decode steps run compiled
(notebook 14_compiled). One seam: ``make_runner`` returns a ``CompiledRunner`` (runner.py);
the scheduler, the pool, sampling and the commit point are rung 3's, so every option of
``paged`` (n > 1, beams, preemption, ``kv_cache_dtype``, ``quantization``) works unchanged --
a step the graph does not cover runs eagerly."""
from __future__ import annotations

from ...core.engine import PagedEngine
from ...layers import tiled
from ...layers.linear import get_linear_kernel
from .config import CompileConfig
from .runner import CompiledRunner


class CompiledEngine(PagedEngine):
    name = "compiled"
    configs = PagedEngine.configs + (CompileConfig,)

    def make_runner(self, num_blocks: int, block_size: int, backend) -> CompiledRunner:
        return CompiledRunner(self.model, num_blocks, block_size, backend,
                              buckets=self.compile_config.buckets,
                              large=self.compile_config.compile_large_batches,
                              wrapper=self.compile_config.compile_wrapper,
                              linear_kernel=self.linear_kernel(), kv_format=self.kv_format,
                              ops=self.layer_ops())

    def linear_kernel(self):
        """This rung's product kernels unless ``linear_backend`` names one: ``tiled`` (gemv's
        streamed rows up to 8, register tiles above; layers/tiled.py) where it is the faster
        kernel here, else the paged engine's default."""
        if self.model_config.linear_backend is None and tiled.preferred(self.model.device,
                                                                        self.model.dtype):
            return get_linear_kernel("tiled", self.model.device, self.model.dtype)
        return super().linear_kernel()

    def warm_up(self) -> None:
        """Compile the decode step for every batch size the scheduler can reach (its
        ``max_num_seqs`` sequences, one block each at least)."""
        rows = min(self.scheduler_config.max_num_seqs, self.block_manager.num_blocks)
        self.runner.warm_up(rows)

    def describe(self) -> dict:
        return {**super().describe(), **self.runner.describe()}


__all__ = ["CompiledEngine"]
