"""Turn a row of logits into the next token: greedy, temperature, top-k, top-p.

Reproducibility is the design goal: the random number used for output token ``i`` of a request is
drawn from ``random.Random((seed, i))``, so a seeded request samples the same tokens whether it ran
alone, in a batch of 64, or was preempted and recomputed halfway. (Its logits can still differ in
the last fp32 bit between batch shapes; that only matters at exact near-ties.)
"""
from __future__ import annotations

import random

import torch

from .request import Request


def sample_next_tokens(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """``logits[i]`` is the next-token distribution of ``requests[i]``; return one token each."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, req in enumerate(requests):
        p = req.params
        if p.greedy:
            out.append(greedy[i])
        else:
            out.append(sample_one(logits[i], p.temperature, p.top_k, p.top_p,
                                  draw_uniform(p.seed, len(req.output_token_ids))))
    return out


def draw_uniform(seed: int | None, index: int) -> float:
    """The uniform number that picks output token ``index``. Unseeded requests use fresh entropy."""
    if seed is None:
        return random.random()
    return random.Random(f"{seed}:{index}").random()


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Probabilities after temperature, top-k and top-p, sorted descending, with their token ids."""
    probs, ids = torch.softmax(logits / temperature, dim=-1).sort(descending=True)
    if top_k > 0:
        probs, ids = probs[:top_k], ids[:top_k]
    if top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = int((probs.cumsum(0) - probs < top_p).sum())
        probs, ids = probs[:max(keep, 1)], ids[:max(keep, 1)]
    return probs / probs.sum(), ids


def sample_one(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """Inverse-CDF sampling with a given uniform ``u`` in [0, 1)."""
    probs, ids = filtered_probs(logits, temperature, top_k, top_p)
    idx = int(torch.searchsorted(probs.cumsum(0), torch.tensor([u], dtype=probs.dtype)).item())
    return int(ids[min(idx, len(ids) - 1)])
