"""What one engine step did (``StepOutput``): what every engine's ``step()`` returns, the run loop
(``driver.py``) records and a server streams."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request


@dataclass
class StepOutput:
    """What one engine step did; ``Engine.record`` adds timing and memory to make a StepRecord."""

    finished: list[Request] = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    batch_size: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
