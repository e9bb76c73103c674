"""Turn a row of logits into the next token: the controls (logit bias, min_tokens, penalties,
min_p), then greedy, temperature, top-k, top-p. The one sampler every rung uses (rungs 0-2 call
``sample_next_tokens``, the paged core's ``Sampler`` calls ``sample_tokens``).

Reproducibility is the design goal: the random number used for output token ``i`` of a request is
drawn from ``random.Random((seed, i))``, so a seeded request samples the same tokens whether it ran
alone, in a batch of 64, or was preempted and recomputed halfway. (Its logits can still differ in
the last fp32 bit between batch shapes; that only matters at exact near-ties.) The controls keep
that promise: each is a per-row tensor operation over the rows that use one, depending only on
the row's own logits, parameters and tokens. So does structured output: a constrained row's
grammar mask (``structured.apply_grammar_masks``) comes first, in place, from its own matcher;
a row whose grammar allows no token at all is not drawn from: it gets ``NO_TOKEN``, which ends
its request with an error at the commit (``Request.commit``).
"""
from __future__ import annotations

import random

import torch

from .request import Request, SamplingParams
from .structured import NO_TOKEN, apply_grammar_masks, row_matcher

# (prompt token ids, output token ids) of a row: what penalties and min_tokens look at
History = tuple[list[int], list[int]]


def sample_next_tokens(logits: torch.Tensor, requests: list[Request],
                       eos_ids: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """``logits[i]`` is the next-token distribution of ``requests[i]``; return one token each.
    ``eos_ids``: what ``min_tokens`` holds back (with each request's ``stop_token_ids``)."""
    return sample_tokens(logits, [r.params for r in requests],
                         [len(r.output_token_ids) for r in requests],
                         histories=[(r.prompt_token_ids, r.output_token_ids) for r in requests],
                         eos_ids=eos_ids, matchers=[row_matcher(r, 0) for r in requests])


def first_max(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, as ``argmax``'s): ``max(dim=-1)``'s indices,
    which torch's CPU kernel finds 2.7x faster than ``argmax`` over SmolLM2's 49,152 logits (25
    against 68 µs a row; a one-row step is ~9 ms)."""
    return logits.max(dim=-1).indices.tolist()


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], indices: list[int],
                  sample_ids: list[int] | None = None, histories: list[History] | None = None,
                  eos_ids: set[int] | frozenset[int] = frozenset(),
                  matchers: list | None = None) -> list[int]:
    """Row i: output token number ``indices[i]`` of sample ``sample_ids[i]`` (n > 1), drawn with
    ``params[i]``; ``histories[i]`` is needed when a row uses a control (penalties,
    ``min_tokens``...); ``matchers[i]``, when not None, is the row's grammar (structured output):
    its mask is applied to ``logits`` in place, first, and a row it allows no token gets
    ``NO_TOKEN`` instead of a draw. Greedy rows are one batched argmax; sampled rows are drawn
    one by one."""
    dead = set()
    if matchers is not None and any(m is not None for m in matchers):
        dead = set(apply_grammar_masks(logits, matchers))
    rows, processed = apply_controls(logits, params, histories, eos_ids)
    at = {r: j for j, r in enumerate(rows)}
    greedy = first_max(logits)
    for j, token in enumerate(first_max(processed) if rows else []):
        greedy[rows[j]] = token
    out = []
    for i, p in enumerate(params):
        if i in dead:
            out.append(NO_TOKEN)
        elif p.greedy:
            out.append(greedy[i])
        else:
            row = processed[at[i]] if i in at else logits[i].float()
            u = draw_uniform(p.seed, indices[i], sample_ids[i] if sample_ids else 0)
            out.append(sample_one(row, p.temperature, p.top_k, p.top_p, u))
    return out


def padded(lists: list[list], pad, device, dtype=torch.long,
           repeat_first: bool = False) -> torch.Tensor:
    """``lists`` as one [rows, longest] tensor, short rows filled with ``pad`` (or, with
    ``repeat_first``, with their own first element)."""
    width = max(1, max(map(len, lists), default=0))
    return torch.tensor([list(x) + [x[0] if repeat_first else pad] * (width - len(x))
                         for x in lists], dtype=dtype, device=device)


def ids_mask(hist: list[History], ids: torch.Tensor) -> torch.Tensor:
    """[rows, width] 1.0 where ``ids`` holds one of the row's output tokens, 0.0 on padding."""
    lengths = torch.tensor([len(h[1]) for h in hist], device=ids.device)[:, None]
    return (torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths).float()


def apply_controls(logits: torch.Tensor, params: list[SamplingParams],
                   histories: list[History] | None,
                   eos_ids: set[int] | frozenset[int] = frozenset()
                   ) -> tuple[list[int], torch.Tensor]:
    """(the rows that use a control, their fp32 logits after it): ``logit_bias``, ``min_tokens``,
    repetition/frequency/presence penalties, then ``min_p`` (after each row's temperature), in
    vLLM's order. Rows that use none are not copied."""
    rows = [i for i, p in enumerate(params) if p.needs_processing]
    if not rows:
        return [], logits[:0]
    if histories is None:
        raise ValueError("sampling controls (penalties, min_tokens, logit_bias...) need each "
                         "row's prompt and output tokens")
    ps, hist = [params[i] for i in rows], [histories[i] for i in rows]
    x, dev = logits[rows].float(), logits.device

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in ps], dtype=x.dtype, device=dev)[:, None]

    if any(p.logit_bias for p in ps):   # padding adds 0.0 to token 0
        ids = padded([[t for t, _ in p.logit_bias] for p in ps], 0, dev)
        x.scatter_add_(1, ids, padded([[b for _, b in p.logit_bias] for p in ps], 0.0, dev,
                                      x.dtype))
    early = [(p.stop_token_ids + (() if p.ignore_eos else tuple(eos_ids)))
             if len(h[1]) < p.min_tokens else () for p, h in zip(ps, hist)]
    if any(early):                      # EOS and stop ids cannot come before min_tokens
        held = [j for j, e in enumerate(early) if e]
        ids = padded([list(early[j]) for j in held], None, dev, repeat_first=True)
        x[held] = x[held].scatter_(1, ids, float("-inf"))
    # The penalties touch only the tokens a row has seen: gathers and scatters over [rows, seen
    # tokens], never a [rows, vocab] pass (HF's processors do the same)
    if any(p.repetition_penalty != 1 for p in ps):          # first, as vLLM applies them
        seen = [list(dict.fromkeys(h[0] + h[1])) or [0] for h in hist]
        ids = padded(seen, None, dev, repeat_first=True)    # a repeat gets the same value
        r = torch.tensor([p.repetition_penalty if h[0] + h[1] else 1.0 for p, h in zip(ps, hist)],
                         dtype=x.dtype, device=dev)[:, None]
        got = x.gather(1, ids)
        x.scatter_(1, ids, torch.where(got > 0, got / r, got * r))
    if any(p.frequency_penalty or p.presence_penalty for p in ps):
        # each occurrence costs frequency_penalty, each distinct token presence_penalty once
        ids = padded([h[1] for h in hist], 0, dev)
        x.scatter_add_(1, ids, -column("frequency_penalty") * (ids_mask(hist, ids)))
        distinct = padded([list(dict.fromkeys(h[1])) for h in hist], 0, dev)
        x.scatter_add_(1, distinct, -column("presence_penalty")
                       * ids_mask([((), list(dict.fromkeys(h[1]))) for h in hist], distinct))
    if any(p.min_p > 0 and not p.greedy for p in ps):
        # p < min_p * p_max at temperature T  <=>  x < x_max + T * log(min_p): one max, no
        # softmax. Greedy rows skip it (log 0 = -inf: nothing is dropped; their top token stays)
        t = torch.tensor([p.temperature or 1.0 for p in ps], device=dev)[:, None]
        min_p = torch.tensor([0.0 if p.greedy else p.min_p for p in ps], device=dev)[:, None]
        x.masked_fill_(x < x.max(dim=-1, keepdim=True).values + t * min_p.log(), float("-inf"))
    return rows, x


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
