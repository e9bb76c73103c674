"""``SpeculativeConfig``: how rung 6 speculates (vLLM's ``speculative_config``, reduced).

Checked when made: a bad field raises a ``ValueError`` naming the field and the value.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...request import check_int

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"              # "ngram": prompt lookup; "draft": a truncated target
    num_speculative_tokens: int = 4    # k: guesses per step (the target checks k + 1 positions)
    prompt_lookup_max: int = 4         # ngram: the longest suffix looked up earlier in the text
    prompt_lookup_min: int = 2         # ngram: the shortest
    draft_layers: int | None = None    # draft: the target's first layers it keeps (default 1/4)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got "
                             f"{self.method!r}")
        self.num_speculative_tokens = check_int("num_speculative_tokens",
                                                self.num_speculative_tokens, 1)
        if self.num_speculative_tokens > 64:
            raise ValueError(f"num_speculative_tokens must be <= 64, got "
                             f"{self.num_speculative_tokens!r}")
        self.prompt_lookup_max = check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        self.prompt_lookup_min = check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.draft_layers is not None:
            self.draft_layers = check_int("draft_layers", self.draft_layers, 1)

    def layers_for(self, num_layers: int) -> int:
        """The draft's depth for a target of ``num_layers`` layers (it cannot be deeper)."""
        k = self.draft_layers if self.draft_layers is not None else max(1, num_layers // 4)
        if k > num_layers:
            raise ValueError(f"draft_layers must be <= the target's {num_layers} layers, got {k!r}")
        return k
