"""``Sequence``: one stream of tokens that owns a block table (vLLM's name for it).

A request with ``n = 1`` is one sequence. With ``n > 1`` (parallel sampling) or beam search, the
request's prompt is prefilled once by its first sequence, which is then *forked*: the children
share the parent's blocks (reference counts go up) and only copy a block when they write into a
shared one (copy-on-write). Notebook 03_block_manager draws it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from ..request import FinishReason, Request

_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: Request
    token_ids: list[int]                 # prompt + generated
    prompt_len: int
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0         # tokens whose K/V are in the cache
    num_cached_tokens: int = 0           # of those, how many came from the prefix cache
    cum_logprob: float = 0.0             # beam search score
    sample_id: int = 0                   # which of the request's n samples this is
    pending_logprobs: torch.Tensor | None = None   # beam search: waiting for the other beams
    finish_reason: FinishReason | None = None
    # rung 6: this step's guesses, computed after token_ids but never part of them
    spec_token_ids: list[int] = field(default_factory=list)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model: the prompt (or what is left of it) during
        prefill, exactly 1 (the newest token) during decode."""
        return self.num_tokens - self.num_computed_tokens

    def input_ids(self, start: int, n: int) -> list[int]:
        """The ``n`` tokens to run from position ``start``: its tokens, then its guesses."""
        ids = self.token_ids[start:start + n]
        if len(ids) < n:
            ids += self.spec_token_ids[:n - len(ids)]
        return ids

    def fork(self) -> "Sequence":
        """A child that shares every block (the caller bumps reference counts)."""
        return Sequence(self.request, list(self.token_ids), self.prompt_len, list(self.block_table),
                        self.num_computed_tokens, self.num_cached_tokens, self.cum_logprob)


@dataclass(eq=False)
class SequenceGroup:
    """A request and its sequences (one, or n / beam_width after the prompt is done)."""

    request: Request
    seqs: list[Sequence]
    arrival_index: int
    arrival_step: int = 0       # the scheduler's step count when it arrived (core/policy.py)
    arrival_ms: float = 0.0     # the scheduler's clock when it arrived (policy "slo", rung 12)
    done_seqs: list[Sequence] = field(default_factory=list)   # finished samples / beams

    def fork_samples(self, seq: Sequence, block_manager) -> list[Sequence]:
        """Once an ``n > 1`` request's prompt is computed, fork n - 1 more samples from it.

        The children share every prompt block (reference counts go up, nothing is copied); the
        first token each one appends into the shared last block triggers copy-on-write."""
        n = self.request.params.n
        if n == 1 or seq.num_tokens != seq.prompt_len:
            return []
        children = []
        for k in range(1, n):
            child = block_manager.fork(seq)
            child.sample_id = k
            children.append(child)
        self.seqs.extend(children)
        return children
