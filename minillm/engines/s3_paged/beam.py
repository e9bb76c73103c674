"""Beam search on the paged engine: keep the ``beam_width`` best continuations (notebook 03).

Each step, every beam of a request has log-probabilities for its next token. The best
``beam_width`` (beam, token) pairs over all beams survive (HF semantics with length_penalty=1,
early_stopping=False). Beams that continue from the same parent *fork* it — the children share its
blocks and copy only the last one on write — and parents nobody continues from are freed. So a
beam's history is never copied, however often the beams reshuffle: that is why beams are cheap
with a block table and expensive with a contiguous cache.
"""
from __future__ import annotations

import time

import torch

from ...request import FinishReason
from .block_manager import BlockManager
from .sequence import Sequence, SequenceGroup


def beam_step(group: SequenceGroup, bm: BlockManager, eos_ids: set[int], max_model_len: int) -> None:
    """Advance ``group``'s beams by one token once every beam has its log-probabilities."""
    beams = group.seqs
    if any(b.pending_logprobs is None for b in beams):
        return  # some beam is still being recomputed after a preemption
    p, width = group.request.params, group.request.params.beam_width
    scores = torch.stack([b.cum_logprob + b.pending_logprobs for b in beams])
    vocab = scores.shape[1]
    top_scores, top_idx = scores.flatten().topk(min(2 * width, scores.numel()))
    chosen: list[tuple[Sequence, int, float]] = []
    gen_len = len(beams[0].output_token_ids) + 1
    for rank, (score, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
        parent, tok = beams[idx // vocab], idx % vocab
        if (not p.ignore_eos and tok in eos_ids) or tok in p.stop_token_ids:
            if rank < width:
                add_hypothesis(group, parent.token_ids + [tok], score / gen_len, parent.prompt_len,
                               FinishReason.STOP)
        elif len(chosen) < width:
            chosen.append((parent, tok, score))
    at_length = gen_len >= p.max_tokens or beams[0].num_tokens + 1 >= max_model_len
    best_running = chosen[0][2] / gen_len if chosen else float("-inf")
    done = at_length or not chosen or (
        len(group.done_seqs) >= width and min(s.cum_logprob for s in group.done_seqs) >= best_running)
    # Fork before any token is appended: a child must copy its parent's pre-step state.
    claimed: set[int] = set()
    new_beams = []
    for parent, tok, score in chosen:
        seq = parent if id(parent) not in claimed else bm.fork(parent)
        claimed.add(id(parent))
        new_beams.append((seq, tok, score))
    for b in beams:
        b.pending_logprobs = None
        if id(b) not in claimed:
            bm.free(b)
    group.seqs = []
    for seq, tok, score in new_beams:
        seq.token_ids.append(tok)
        seq.cum_logprob = score
        if done:
            add_hypothesis(group, seq.token_ids, score / gen_len, seq.prompt_len, FinishReason.LENGTH)
            bm.free(seq)
        else:
            group.seqs.append(seq)
    if group.request.first_token_time is None:
        group.request.first_token_time = time.perf_counter()


def add_hypothesis(group: SequenceGroup, tokens: list[int], score: float, prompt_len: int,
                   reason: FinishReason) -> None:
    """A finished beam (its score length-normalized); only the best ``beam_width`` are kept."""
    hyp = Sequence(group.request, list(tokens), prompt_len, cum_logprob=score)
    hyp.finish_reason = reason
    group.done_seqs.append(hyp)
    group.done_seqs.sort(key=lambda s: -s.cum_logprob)
    del group.done_seqs[group.request.params.beam_width:]
