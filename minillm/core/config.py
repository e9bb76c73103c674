"""The paged engine's configs (notebook 03): ``CacheConfig`` (the KV pool) and
``SchedulerConfig`` (what one step may hold). How options work: ``minillm/runtime/config.py``."""
from __future__ import annotations

from dataclasses import dataclass

from ..layers.kv_quant import KV_CACHE_DTYPES
from ..runtime.config import check_bool, option, set_checked

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool: its blocks, how many (notebook 03) and how wide each slot is (notebook 09)."""

    block_size: int = option(16, "paged: tokens per KV block")
    num_blocks: int | None = option(None, "paged: KV pool size in blocks")
    kv_cache_bytes: int | None = option(None, "paged: KV pool size in bytes (default 1 GiB)")
    enable_prefix_caching: bool = option(False, "paged: reuse KV blocks of shared prompt "
                                                "prefixes")
    kv_cache_dtype: str = option("auto", "paged: how KV is stored: auto (the model's dtype), "
                                         "float16, bfloat16, int8 or fp8 (layers/kv_quant.py)")

    def __post_init__(self):
        set_checked(self, "block_size")
        set_checked(self, "num_blocks", optional=True)
        set_checked(self, "kv_cache_bytes", optional=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}: choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")

    def num_blocks_for(self, bytes_per_token: int, max_model_len: int, max_num_seqs: int) -> int:
        """Blocks in the pool: ``num_blocks``, or as many as ``kv_cache_bytes`` hold (default
        1 GiB, but no more than ``max_num_seqs`` sequences at full length could use)."""
        if self.num_blocks is not None:
            return self.num_blocks
        block_bytes = self.block_size * bytes_per_token
        if self.kv_cache_bytes is None:
            n = DEFAULT_KV_CACHE_BYTES // block_bytes
            return int(min(n, max_num_seqs * -(-max_model_len // self.block_size)))
        if self.kv_cache_bytes < block_bytes:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} is smaller than one block "
                             f"({block_bytes} bytes)")
        return self.kv_cache_bytes // block_bytes


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold: the token budget and the running requests."""

    max_num_batched_tokens: int = option(1024, "paged: token budget per step")
    max_num_seqs: int = option(64, "paged: max concurrent requests")

    def __post_init__(self):
        set_checked(self, "max_num_batched_tokens")
        set_checked(self, "max_num_seqs")


__all__ = ["CacheConfig", "DEFAULT_KV_CACHE_BYTES", "SchedulerConfig"]
