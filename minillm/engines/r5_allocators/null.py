"""An engine's model and runner that compute nothing (rung 5's replays, notebook 05; rung 12's
simulator): memory waste and scheduling depend only on who holds which slots when, not on what
the model computes, so the real ``PagedEngine`` runs on these in a fraction of a second."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ...core.runner import reaching_end, step_order
from ...core.sequence import Sequence

REPLAY_EOS = -2       # the replay "model"'s end-of-sequence token: ends each sample where it ended


@dataclass
class ReplayModel:
    """What the engine reads off a model, for replays that run none."""

    max_model_len: int
    kv_bytes_per_token: int
    eos_token_ids: set[int] = field(default_factory=lambda: {REPLAY_EOS})
    tokenizer: object = None
    device: torch.device = torch.device("cpu")
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(vocab_size=1 << 31))


class NullRunner:
    """A model runner that computes nothing. Which sequences reach their newest token, and in
    what order, is decided exactly as in ``ModelRunner.run``, so forks and frees happen in the
    engine's own order."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], None]:
        order = step_order(scheduled)
        return [order[k][0] for k in reaching_end(order)], None
