"""Acceptance: which of the proposer's guesses the target keeps (notebook 06).

Greedy: the longest prefix of the guesses equal to the target's argmax at each position, then the
target's own argmax at the first position that differs (or after the last guess). The output is
exactly what plain greedy decoding gives; speculation only changes how many forwards it takes.

Sampling (Leviathan et al. 2023; Chen et al. 2023): guess ``d`` was drawn from the proposer's
distribution ``q``; keep it with probability ``min(1, p(d) / q(d))`` where ``p`` is the target's
(after temperature, top-k, top-p); on the first rejection draw from ``max(0, p - q)``
renormalized and stop. Every token then follows ``p`` exactly, whatever ``q`` is: a good ``q``
only makes acceptance likelier. The n-gram proposer's guess is certain (``q`` is a point mass).

The uniforms come from the request's seed and the output index they decide (never from the
batch), so with a fixed seed the result does not depend on what else is in the batch.
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
    """A uniform for output token ``index`` used by speculation (``tag``: "draft" to draw a guess,
    "accept" to test it, "resample" after a rejection). Unseeded requests use fresh entropy."""
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


def accept(proposals: list[int], draft_probs: torch.Tensor | None, logits: torch.Tensor,
           p: SamplingParams, first_index: int) -> list[int]:
    """The acceptance rule for a request: greedy or rejection sampling."""
    if p.greedy:
        return accept_greedy(proposals, logits.argmax(dim=-1).tolist())
    return accept_sampled(proposals, draft_probs, logits, p, first_index)
