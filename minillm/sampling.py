"""Turn a row of logits into the next token: greedy, temperature, top-k, top-p.

Reproducibility is the design goal: the random number used for output token ``i`` of a request is
drawn from ``random.Random((seed, i))``, so a seeded request samples the same tokens whether it ran
alone, in a batch of 64, or was preempted and recomputed halfway. (Its logits can still differ in
the last fp32 bit between batch shapes; that only matters at exact near-ties.)
"""
from __future__ import annotations

import random

import torch

from .request import Request, SamplingParams


def sample_next_tokens(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """``logits[i]`` is the next-token distribution of ``requests[i]``; return one token each."""
    return sample_tokens(logits, [r.params for r in requests],
                         [len(r.output_token_ids) for r in requests])


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
                  sample_ids: list[int] | None = None) -> list[int]:
    """Row i: output token number ``indices[i]`` of sample ``sample_ids[i]`` (n > 1), drawn with
    ``params[i]``. Greedy rows are one batched argmax; sampled rows are drawn one by one."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.greedy:
            out.append(greedy[i])
        else:
            u = draw_uniform(p.seed, indices[i], sample_ids[i] if sample_ids else 0)
            out.append(sample_one(logits[i].float(), p.temperature, p.top_k, p.top_p, u))
    return out


def draw_uniform(seed: int | None, index: int, sample_id: int = 0) -> float:
    """The uniform number that picks output token ``index`` of sample ``sample_id``.
    Unseeded requests use fresh entropy."""
    if seed is None:
        return random.random()
    return random.Random(f"{seed}:{sample_id}:{index}").random()


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
    idx = int(torch.searchsorted(probs.cumsum(0), probs.new_tensor([u])).item())
    return int(ids[min(idx, len(ids) - 1)])
