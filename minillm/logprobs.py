"""Log-probabilities of chosen tokens and the top-k beside them (``SamplingParams.logprobs`` and
``prompt_logprobs``; notebook 03 samples, the server's ``logprobs`` fields read these).

vLLM's default "raw" mode: the ``log_softmax`` of the model's fp32 logits, before temperature,
penalties or filters, so a token's logprob says what the *model* thought of it, whatever the
sampler then did. Only the rows that ask are computed: a [rows, vocab] ``log_softmax``, then one
``gather`` for the chosen tokens and one ``topk`` for the widest k among them.
"""
from __future__ import annotations

import torch

TokenLogprobs = dict[int, float]


def token_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row i: ``{chosen[i]: its logprob, then the ks[i] most likely tokens: theirs}`` (the chosen
    token first, as vLLM orders them; it appears once even when it is also in the top k)."""
    if not chosen:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(chosen, dtype=torch.long, device=lp.device)
    own = lp.gather(1, ids[:, None])[:, 0].tolist()
    k = max(ks)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out = []
    for r, (token, value) in enumerate(zip(chosen, own)):
        entry = {token: value}
        for t, v in zip(top_i[r][:ks[r]], top_v[r][:ks[r]]):
            entry.setdefault(t, v)
        out.append(entry)
    return out
