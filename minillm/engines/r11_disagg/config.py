"""``DisaggConfig``: rung 11's prefill worker — its budget, its pool, its threads, its timeout.
The decode side (rank 0) takes rung 3's options; the prefill worker gets the same layout (block
size, KV dtype, backends) so that a block means the same bytes on both sides."""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime.config import check_bool, option, set_checked


@dataclass(frozen=True)
class DisaggConfig:
    prefill_max_num_batched_tokens: int | None = option(
        None, "disagg: the prefill worker's token budget per step (default: "
              "max_num_batched_tokens)")
    prefill_kv_cache_bytes: int | None = option(
        None, "disagg: the prefill worker's KV pool in bytes (default: kv_cache_bytes)")
    worker_threads: int = option(1, "disagg: torch threads of the prefill worker")
    transfer_timeout_s: int = option(60, "disagg: seconds any wait on the other worker may take "
                                         "before it is an error")
    local_prefill_max_tokens: int = option(
        0, "disagg: prompts of at most this many tokens are prefilled on the decode side (a "
           "short prefill costs a decode step little, a hand-off a round of messages); 0: every "
           "prompt goes to the prefill worker")
    lockstep: bool = option(False, "disagg: wait for the prefill worker's reply every step: "
                                   "reproducible schedules, but the decodes then wait for each "
                                   "prefill step, as in one engine")

    def __post_init__(self):
        set_checked(self, "prefill_max_num_batched_tokens", optional=True)
        set_checked(self, "prefill_kv_cache_bytes", optional=True)
        set_checked(self, "worker_threads")
        set_checked(self, "transfer_timeout_s")
        set_checked(self, "local_prefill_max_tokens", 0)
        check_bool("lockstep", self.lockstep)
