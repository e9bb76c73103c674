"""``LoRAConfig``: rung 13's options (vLLM's ``lora_config``: ``enable_lora``, ``max_loras``,
``max_lora_rank``). ``paged`` with ``enable_lora=True`` (``--enable-lora``) is this rung's engine
(notebook 13_multi_lora).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime.config import check_bool, option, set_checked

LORA_KERNELS = ("sgmv", "bgmv", "triton")
MAX_LORA_RANK = 256       # vLLM's largest supported rank as well


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = option(False, "LoRA (rung 13): serve requests with PEFT adapters, many in "
                                      "one batch (with --engine paged it selects the multi-LoRA "
                                      "engine)")
    max_loras: int = option(4, "lora: adapters resident on the device at once (slots); a request "
                               "whose adapter has none waits while least recently used ones are "
                               "swapped in from host memory")
    max_lora_rank: int = option(16, "lora: the largest adapter rank accepted (every slot is padded "
                                    "to it)")
    max_lora_skips: int = option(32, "lora: steps a request waiting for an adapter slot may be "
                                     "skipped by adapter requests behind it; then they wait until "
                                     "it has one (base-model requests never wait for it)")
    lora_kernel: str = option("sgmv", "lora: how each row's low-rank delta is computed: sgmv (the "
                                      "rows of each adapter together, one matmul pair per adapter "
                                      "present), bgmv (each row gathers its slot's A and B, one "
                                      "batched matmul) or triton (bgmv as one Triton kernel "
                                      "reading A and B in place; the interpreter on a CPU)")

    def __post_init__(self):
        check_bool("enable_lora", self.enable_lora)
        if not self.enable_lora:
            raise ValueError("enable_lora must be True for the multi-LoRA engine, got False")
        set_checked(self, "max_loras")
        set_checked(self, "max_lora_rank")
        set_checked(self, "max_lora_skips", minimum=0)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {self.max_lora_rank!r}")
        if self.lora_kernel not in LORA_KERNELS:
            raise ValueError(f"unknown lora_kernel {self.lora_kernel!r}: choose "
                             f"{' or '.join(map(repr, LORA_KERNELS))}")
