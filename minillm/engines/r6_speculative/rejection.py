"""Acceptance: which of the proposer's guesses the target keeps (notebook 06).

Greedy: the longest prefix of the guesses equal to the target's argmax at each position, then the
target's own argmax at the first position that differs (or after the last guess). The output is
exactly what plain greedy decoding gives; speculation only changes how many forwards it takes.

Seeded sampling (``accept_seeded``), the seed promise: the token at output index ``i`` of a seeded
request is a function of (seed, sample id, ``i``, the target's logits at ``i``) only — not of the
batch, the pool, a preemption, or whether position ``i`` was guessed. So the target's token at each
verified position is drawn exactly as plain decoding draws it (``sample_one`` with
``draw_uniform(seed, i)``); a guess is kept iff it equals that token; at the first mismatch the
target's draw is emitted and the rest is dropped. This is the greedy rule with the argmax replaced
by the seeded draw, and it is exact: every emitted token *is* plain decoding's sample.

* For a certain guess ``x`` (the n-gram proposer: ``q`` a point mass) it is rejection sampling with
  coupled randomness: ``x`` is kept with probability ``p(x) = min(1, p(x) / q(x))``, and a rejected
  guess leaves the target's draw conditioned on ``!= x``, which is ``max(0, p - q)`` renormalized —
  Leviathan's rule, with the same acceptance rate.
* For the draft model (guesses drawn from its own ``q``), the draft draws its guess for index ``i``
  with the same uniform ``draw_uniform(seed, i)`` (``DraftModelProposer._draw``): two inverse-CDF
  draws from one uniform agree often when ``q`` is close to ``p``. They agree less often than
  ``min(1, p / q)`` accepts (``sum(min(p, q))``, the best any rule can do): both draws walk the
  vocabulary sorted by their own distribution, so where ``q`` orders the tokens differently they
  part, most on flat distributions. That is the price of a sample that never depends on the batch
  (docs/rungs/06_speculative.md: measured).

Unseeded sampling (``accept_sampled``: Leviathan et al. 2023; Chen et al. 2023) makes no batch
promise, so it keeps the rejection rule that accepts most: guess ``d`` drawn from ``q`` is kept with
probability ``min(1, p(d) / q(d))`` where ``p`` is the target's (after temperature, top-k, top-p);
on the first rejection a token is drawn from ``max(0, p - q)`` renormalized and the step stops.
Every token then follows ``p`` exactly, whatever ``q`` is: a good ``q`` only makes acceptance
likelier. (Its uniforms come from ``spec_uniform``: fresh entropy, or a seed's when tests pass one.)
"""
from __future__ import annotations

import random

import torch

from ...request import SamplingParams
from ...sampling import draw_uniform, filtered_probs, sample_one


def accept_greedy(proposals: list[int], target_argmax: list[int]) -> list[int]:
    """Tokens to append: ``target_argmax[j]`` is the target's choice after guess ``j - 1``
    (``len(proposals) + 1`` entries). Always at least one token: the target's own."""
    out = []
    for guess, target in zip(proposals, target_argmax):
        out.append(target)
        if guess != target:
            return out
    out.append(target_argmax[len(proposals)])
    return out


def spec_uniform(seed: int | None, index: int, tag: str) -> float:
    """A uniform for output token ``index`` used by ``accept_sampled`` (``tag``: "accept" to test a
    guess, "resample" after a rejection). The engine calls it for unseeded requests only (fresh
    entropy); a seed, as tests pass, makes it reproducible."""
    if seed is None:
        return random.random()
    return random.Random(f"{seed}:spec-{tag}:{index}").random()


def full_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filtered distribution (temperature, top-k, top-p) over the whole vocabulary."""
    probs, ids = filtered_probs(logits.float(), p.temperature, p.top_k, p.top_p)
    return torch.zeros(logits.shape[-1], dtype=probs.dtype, device=probs.device).scatter_(0, ids, probs)


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    idx = int(torch.searchsorted(probs.cumsum(0), probs.new_tensor([u * float(probs.sum())]), right=True).item())
    nonzero = probs.nonzero()
    return min(idx, int(nonzero[-1])) if len(nonzero) else idx


def accept_sampled(proposals: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
                   p: SamplingParams, first_index: int) -> list[int]:
    """Rejection sampling. ``logits[j]``: the target's logits for output token ``first_index + j``
    (``len(proposals) + 1`` rows); ``draft_probs[j]`` the proposer's ``q`` for guess ``j`` (None:
    each guess was certain). Returns the tokens to append (at least one)."""
    out = []
    for j, guess in enumerate(proposals):
        index = first_index + j
        target = full_probs(logits[j], p)
        if draft_probs is None:
            q_guess, q = 1.0, torch.zeros_like(target).index_fill_(0, torch.tensor([guess]), 1.0)
        else:
            q = draft_probs[j].to(target.dtype)
            q_guess = float(q[guess])
        if spec_uniform(p.seed, index, "accept") * q_guess < float(target[guess]):
            out.append(guess)
            continue
        residual = (target - q).clamp_(min=0)
        if float(residual.sum()) <= 0:      # p == q up to rounding: p itself is the residual
            residual = target
        out.append(inverse_cdf(residual, spec_uniform(p.seed, index, "resample")))
        return out
    # every guess kept: the target's own next token, drawn exactly as plain decoding draws it
    index = first_index + len(proposals)
    out.append(sample_one(logits[-1].float(), p.temperature, p.top_k, p.top_p,
                          draw_uniform(p.seed, index)))
    return out


def accept_seeded(proposals: list[int], logits: torch.Tensor, p: SamplingParams,
                  first_index: int, sample_id: int = 0) -> list[int]:
    """The seed promise: ``logits[j]`` is the target's for output token ``first_index + j``
    (``len(proposals) + 1`` rows); the target's token there is plain decoding's draw
    (``draw_uniform(p.seed, first_index + j, sample_id)``). Keep the guesses while they equal it;
    at the first that differs, or after the last guess, emit the target's own draw and stop."""
    out = []
    for j, guess in enumerate(proposals):
        target = sample_one(logits[j].float(), p.temperature, p.top_k, p.top_p,
                            draw_uniform(p.seed, first_index + j, sample_id))
        out.append(target)
        if guess != target:
            return out
    index = first_index + len(proposals)
    out.append(sample_one(logits[-1].float(), p.temperature, p.top_k, p.top_p,
                          draw_uniform(p.seed, index, sample_id)))
    return out


def accept(proposals: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
           p: SamplingParams, first_index: int, sample_id: int = 0) -> list[int]:
    """The acceptance rule for a request: greedy, seeded (the same tokens as plain decoding,
    whatever the batch) or, without a seed, rejection sampling."""
    if p.greedy:
        return accept_greedy(proposals, logits.argmax(dim=-1).tolist())
    if p.seed is not None:
        return accept_seeded(proposals, logits, p, first_index, sample_id)
    return accept_sampled(proposals, draft_probs, logits, p, first_index)
