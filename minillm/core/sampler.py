"""``Sampler``: the step's logits -> what the scheduler commits (notebook 03).

Plain sequences (n = 1 and each of n parallel samples) get a token, drawn with the request's own
seeded randomness and controls (``minillm.sampling``); beams get log-probabilities, which beam
search compares across the request's beams (``beam.py``). A row whose request asks ``logprobs``
also gets its token's log-probability and the top k (``minillm.logprobs``: the raw model
distribution, before the controls; a structured-output row's grammar mask comes first, as in
vLLM), carried as a third item of its ``(sequence, token)`` pair to
the commit point. The visualizer swaps this class for one that replays recorded tokens, and the
model runner for one that computes nothing: same scheduler, same blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..logprobs import TokenLogprobs, token_logprobs
from ..sampling import sample_tokens
from ..structured import NO_TOKEN, row_matcher
from .sequence import Sequence

# (sequence, token) or (sequence, token, its logprobs) when the request asks for them
Tokens = list[tuple[Sequence, int] | tuple[Sequence, int, TokenLogprobs]]
BeamLogprobs = list[tuple[Sequence, torch.Tensor]]


@dataclass
class SamplerOutput:
    """What a step's logits became, for the commit point (``Scheduler.update_from_output``):
    tokens, beams' log-probabilities, the tokens each speculating sequence keeps (rung 6's
    ``verify``) and the prompt log-probabilities the forward computed."""

    tokens: Tokens
    beam_logprobs: BeamLogprobs
    accepted: dict[Sequence, list[int]] | None = None
    prompt_logprobs: list = field(default_factory=list)   # (sequence, first token, entries)


class Sampler:
    def __init__(self, eos_ids: set[int] | frozenset[int] = frozenset()):
        """``eos_ids``: the tokens ``min_tokens`` holds back (beside each request's stop ids)."""
        self.eos_ids = frozenset(eos_ids)

    def __call__(self, logits: torch.Tensor, rows: list[tuple[int, Sequence]]) -> tuple[Tokens, BeamLogprobs]:
        plain = [(i, s) for i, s in rows if s.request.params.beam_width == 1]
        idx = [i for i, _ in plain]
        # the usual step samples every row once, in order: no [rows, vocab] copy for that
        mine = logits if idx == list(range(logits.shape[0])) else logits[idx]
        params = [s.request.params for _, s in plain]
        # what penalties and min_tokens read, built only when a row uses one
        histories = [(s.token_ids[:s.prompt_len], s.output_token_ids) for _, s in plain] \
            if any(p.needs_processing for p in params) else None
        # a grammar per constrained sample (structured output): each masks its own row
        matchers = [row_matcher(s.request, s.sample_id) for _, s in plain] \
            if any(p.structured_outputs is not None for p in params) else None
        tokens = sample_tokens(mine, params, [s.num_tokens - s.prompt_len for _, s in plain],
                               [s.sample_id for _, s in plain], histories,
                               self.eos_ids, matchers) if plain else []
        out: Tokens = list(zip([s for _, s in plain], tokens))
        # a row that got no token (its grammar allows none) has no logprobs: its request fails
        asking = [r for r, (_, s) in enumerate(plain) if s.request.params.logprobs is not None
                  and tokens[r] != NO_TOKEN]
        if asking:
            found = token_logprobs(mine[asking], [tokens[r] for r in asking],
                                   [plain[r][1].request.params.logprobs for r in asking])
            for r, entry in zip(asking, found):
                out[r] = (*out[r], entry)
        beams = [(s, torch.log_softmax(logits[i].float(), dim=-1))
                 for i, s in rows if s.request.params.beam_width > 1]
        return out, beams


def split_lookahead(reached: list[Sequence], logits: torch.Tensor
                    ) -> tuple[list[Sequence], torch.Tensor, dict[Sequence, torch.Tensor]]:
    """A forward's rows apart: (the sequences to sample, their rows, and the 1 + k rows of each
    sequence with k guesses, for ``verify``: rung 6)."""
    plain, lookahead, r = [], {}, 0
    for seq in reached:
        k = len(seq.spec_token_ids)
        if k:
            lookahead[seq] = logits[r:r + k + 1]
        else:
            plain.append(r)
        r += k + 1
    if lookahead:
        logits = logits[plain]
    return [s for s in reached if not s.spec_token_ids], logits, lookahead
