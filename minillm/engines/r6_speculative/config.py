"""``SpeculativeConfig``: how rung 6 speculates (vLLM's ``speculative_config``, reduced).

Frozen and checked when made: a bad field raises a ``ValueError`` naming the field and the value.
Its fields are engine options (``minillm.core.config``); ``method`` is the option ``speculative``,
which also takes a whole ``SpeculativeConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime.config import option, set_checked

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = option("ngram", "paged: speculative decoding, ngram (prompt lookup) or draft "
                                  "(the model's first layers); n > 1 and beam requests decode "
                                  "normally", name="speculative")
    # k: guesses per step (the target checks k + 1 positions)
    num_speculative_tokens: int = option(4, "speculative: tokens guessed per step (k)")
    prompt_lookup_max: int = option(4, "speculative ngram: longest suffix looked up")
    prompt_lookup_min: int = option(2, "speculative ngram: shortest suffix looked up")
    draft_layers: int | None = option(None, "speculative draft: layers of the model the draft "
                                            "keeps (default 1/4)")

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got "
                             f"{self.method!r}")
        set_checked(self, "num_speculative_tokens")
        if self.num_speculative_tokens > 64:
            raise ValueError(f"num_speculative_tokens must be <= 64, got "
                             f"{self.num_speculative_tokens!r}")
        set_checked(self, "prompt_lookup_max")
        set_checked(self, "prompt_lookup_min")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        set_checked(self, "draft_layers", optional=True)

    def layers_for(self, num_layers: int) -> int:
        """The draft's depth for a target of ``num_layers`` layers (it cannot be deeper)."""
        k = self.draft_layers if self.draft_layers is not None else max(1, num_layers // 4)
        if k > num_layers:
            raise ValueError(f"draft_layers must be <= the target's {num_layers} layers, got {k!r}")
        return k
