"""Beam search on the paged engine: keep the ``beam_width`` best continuations (notebook 03).

Each step, every beam of a request has log-probabilities for its next token. The best
``beam_width`` (beam, token) pairs over all beams survive (HF semantics with length_penalty=1,
early_stopping=False). Beams that continue from the same parent *fork* it — the children share its
blocks and copy only the last one on write — and parents nobody continues from are freed. So a
beam's history is never copied, however often the beams reshuffle: that is why beams are cheap
with a block table and expensive with a contiguous cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocator import KVAllocator
from ..request import FinishReason
from .sequence import Sequence, SequenceGroup


@dataclass
class BeamChoice:
    """One step of one request's beam search, as indices into its beams (so it can be recorded,
    and replayed by the visualizer without the model): the continuations kept, the ones that
    stopped (end-of-sequence among the best), and whether the search is over."""

    kept: list[tuple[int, int, float]]       # (parent beam, token, cumulative log-prob)
    stopped: list[tuple[int, int, float]]
    done: bool

    def to_list(self) -> list:
        return [[list(k) for k in self.kept], [list(k) for k in self.stopped], self.done]

    @classmethod
    def from_list(cls, d: list) -> "BeamChoice":
        return cls([tuple(k) for k in d[0]], [tuple(k) for k in d[1]], bool(d[2]))


def select_beams(group: SequenceGroup, eos_ids: set[int], max_model_len: int) -> BeamChoice:
    """The best ``beam_width`` continuations over all beams, from their log-probabilities."""
    beams = group.seqs
    p, width = group.request.params, group.request.params.beam_width
    scores = torch.stack([b.cum_logprob + b.pending_logprobs for b in beams])
    vocab = scores.shape[1]
    top_scores, top_idx = scores.flatten().topk(min(2 * width, scores.numel()))
    kept, stopped = [], []
    gen_len = len(beams[0].output_token_ids) + 1
    for rank, (score, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
        parent, tok = idx // vocab, idx % vocab
        if (not p.ignore_eos and tok in eos_ids) or tok in p.stop_token_ids:
            if rank < width:
                stopped.append((parent, tok, score))
        elif len(kept) < width:
            kept.append((parent, tok, score))
    at_length = gen_len >= p.max_tokens or beams[0].num_tokens + 1 >= max_model_len
    best_running = kept[0][2] / gen_len if kept else float("-inf")
    finished = sorted([s.cum_logprob for s in group.done_seqs] + [s / gen_len for *_, s in stopped],
                      reverse=True)[:width]
    done = at_length or not kept or (len(finished) >= width and min(finished) >= best_running)
    return BeamChoice(kept, stopped, done)


def beam_step(group: SequenceGroup, bm: KVAllocator, eos_ids: set[int], max_model_len: int,
              select=select_beams) -> tuple[BeamChoice, list[tuple[Sequence, int]]] | None:
    """Advance ``group``'s beams by one token once every beam has its log-probabilities; return
    the choice made and the (beam, token) continuations for the scheduler to append
    (``StepCommit._append``, core/commit.py), or None while a beam still waits. ``select`` makes the choice (the
    visualizer passes one that replays a recorded search)."""
    beams = group.seqs
    if any(b.pending_logprobs is None for b in beams):
        return None  # some beam is still being recomputed after a preemption
    choice = select(group, eos_ids, max_model_len)
    gen_len = len(beams[0].output_token_ids) + 1
    for parent, tok, score in choice.stopped:
        add_hypothesis(group, beams[parent].token_ids + [tok], score / gen_len,
                       beams[parent].prompt_len, FinishReason.STOP)
    # Beams nobody continues from are freed first, so their memory can hold the new forks (a
    # contiguous allocator needs a free region per fork). Forks happen before any token is
    # appended: a child must copy its parent's pre-step state.
    parents = {parent for parent, _, _ in choice.kept}
    for i, b in enumerate(beams):
        b.pending_logprobs = None
        if i not in parents:
            bm.free(b)
    claimed: set[int] = set()
    new_beams = []
    for parent, tok, score in choice.kept:
        seq = beams[parent] if parent not in claimed else bm.fork(beams[parent])
        claimed.add(parent)
        new_beams.append((seq, tok, score))
    group.seqs = []
    continuations = []
    for seq, tok, score in new_beams:
        seq.cum_logprob = score
        if choice.done:
            add_hypothesis(group, seq.token_ids + [tok], score / gen_len, seq.prompt_len,
                           FinishReason.LENGTH)
            bm.free(seq)
        else:
            group.seqs.append(seq)
            continuations.append((seq, tok))
    return choice, continuations


def add_hypothesis(group: SequenceGroup, tokens: list[int], score: float, prompt_len: int,
                   reason: FinishReason) -> None:
    """A finished beam (its score length-normalized); only the best ``beam_width`` are kept."""
    hyp = Sequence(group.request, list(tokens), prompt_len, cum_logprob=score)
    hyp.finish_reason = reason
    group.done_seqs.append(hyp)
    group.done_seqs.sort(key=lambda s: -s.cum_logprob)
    del group.done_seqs[group.request.params.beam_width:]
