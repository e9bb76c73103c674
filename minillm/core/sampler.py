"""``Sampler``: the step's logits -> what the scheduler commits (notebook 03).

Plain sequences (n = 1 and each of n parallel samples) get a token, drawn with the request's own
seeded randomness (``minillm.sampling``); beams get log-probabilities, which beam search compares
across the request's beams (``beam.py``). The visualizer swaps this class for one that replays
recorded tokens, and the model runner for one that computes nothing: same scheduler, same blocks.
"""
from __future__ import annotations

import torch

from ..sampling import sample_tokens
from .sequence import Sequence

Tokens = list[tuple[Sequence, int]]
BeamLogprobs = list[tuple[Sequence, torch.Tensor]]


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[tuple[int, Sequence]]) -> tuple[Tokens, BeamLogprobs]:
        plain = [(i, s) for i, s in rows if s.request.params.beam_width == 1]
        idx = [i for i, _ in plain]
        # the usual step samples every row once, in order: no [rows, vocab] copy for that
        mine = logits if idx == list(range(logits.shape[0])) else logits[idx]
        tokens = sample_tokens(mine, [s.request.params for _, s in plain],
                               [len(s.output_token_ids) for _, s in plain],
                               [s.sample_id for _, s in plain]) if plain else []
        beams = [(s, torch.log_softmax(logits[i].float(), dim=-1))
                 for i, s in rows if s.request.params.beam_width > 1]
        return list(zip([s for _, s in plain], tokens)), beams
