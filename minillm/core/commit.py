"""The one commit point of a step: what the forward pass and the sampler produced joins the
requests (vLLM's ``Scheduler.update_from_output``; notebook 03).

``StepCommit`` is the scheduler's second half: ``update_after_forward`` counts the K/V the forward
wrote (and forks n > 1 samples, whose rows the sampler then draws from), ``update_from_output``
commits the sampled tokens through ``_append`` — the only place tokens, first-token times and stop
checks happen (``Request.commit``) — advances beams and frees what finished.
``core/scheduler.py`` plans the step; this module commits it.
"""
from __future__ import annotations

from collections.abc import Callable

from ..logprobs import TokenLogprobs
from ..request import FinishReason, Request
from .allocator import KVAllocator
from .beam import BeamChoice, beam_step
from .sampler import SamplerOutput
from .sequence import Sequence, SequenceGroup

SelectBeams = Callable[[SequenceGroup, set[int], int], BeamChoice]
Emit = Callable[..., None]          # ``Observers.emit(phase, request_id, data)``


class StepCommit:
    """Committing a step, for ``Scheduler`` (which owns these attributes and ``finish``)."""

    allocator: KVAllocator
    groups: dict[str, SequenceGroup]
    eos_ids: set[int]
    max_model_len: int
    select_beams: SelectBeams
    emit: Emit

    def finish(self, group: SequenceGroup) -> None:
        raise NotImplementedError

    def update_after_forward(self, out: SchedulerOutput) -> None:
        """The forward pass wrote these tokens' K/V: count them, offer full blocks to the cache
        (a block holding guesses is never offered: ``cache_full_blocks`` hashes tokens only),
        and fork the n - 1 other samples of a request whose prompt is now computed."""
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.allocator.cache_full_blocks(seq)
            if seq.request.params.n > 1 and seq.num_computed_tokens == seq.num_tokens:
                self.groups[seq.request.request_id].fork_samples(seq, self.allocator)

    def rows_to_sample(self, reached: list[Sequence]) -> list[tuple[int, Sequence]]:
        """(logits row, sequence) pairs to sample: each sequence that reached its newest token,
        plus the samples just forked from it (same row: they share its prompt)."""
        rows = []
        for i, seq in enumerate(reached):
            if seq.num_tokens == seq.prompt_len and seq.request.params.n > 1:
                group = self.groups[seq.request.request_id]
                rows += [(i, c) for c in group.seqs
                         if c is not seq and c.num_tokens == c.prompt_len]
            rows.append((i, seq))
        return rows

    def update_from_output(self, sampled: SamplerOutput) -> list[Request]:
        """The one commit point of a step's output (vLLM's name): prompt log-probabilities
        (``Request.commit_prompt_logprobs`` keeps their order and skips what a preempted request
        already had), sampled tokens appended, guesses kept or given back (rung 6's
        ``accepted``: a prefix of the guesses plus the target's own token), beams advanced,
        what finished freed; returns the requests that finished."""
        for seq, first, entries in sampled.prompt_logprobs:
            seq.request.commit_prompt_logprobs(first, entries)
        tokens, beam_logprobs = sampled.tokens, sampled.beam_logprobs
        accepted = sampled.accepted or {}
        touched: dict[int, SequenceGroup] = {}
        for seq, *_ in tokens + beam_logprobs + list(accepted.items()):
            group = self.groups[seq.request.request_id]
            touched.setdefault(id(group), group)
        for seq, kept in accepted.items():
            self._accept(seq, kept)
        for seq, token, *logprobs in tokens + [(s, kept[-1]) for s, kept in accepted.items()]:
            self._append(seq, [token], logprobs=logprobs or None)   # logprobs: [one dict] if asked
        for seq, logprobs in beam_logprobs:
            seq.pending_logprobs = logprobs
        finished = []
        for group in touched.values():
            if group.request.params.beam_width > 1:
                self._advance_beams(group)
            if not group.seqs:
                finished.append(self.finish_group(group))
        return finished

    def _accept(self, seq: Sequence, kept: list[int]) -> None:
        """Verified lookahead: keep the K/V of the newest token and of the guesses kept (all but
        the last kept token, which is the target's own and has no K/V yet), free the rest."""
        seq.spec_token_ids = []
        self.allocator.truncate(seq, seq.num_tokens + len(kept) - 1)
        self._append(seq, kept[:-1])      # none of them stops it: verify cut after the first stop
        self.allocator.cache_full_blocks(seq)                  # full blocks of kept tokens only

    def _advance_beams(self, group: SequenceGroup) -> None:
        """One beam-search step (``beam.py``); its continuations are appended like any token."""
        stepped = beam_step(group, self.allocator, self.eos_ids, self.max_model_len, self.select_beams)
        if stepped is not None:
            choice, continuations = stepped
            self.emit("beam", group.request.request_id, choice)
            group.request.commit(None, (), self.eos_ids, self.max_model_len)   # first-token time
            for seq, token in continuations:
                self._append(seq, [token], beam=True)

    def _append(self, seq: Sequence, tokens: list[int], beam: bool = False,
              logprobs: list[TokenLogprobs] | None = None) -> None:
        """The one place a step's tokens join a sequence: committed to its request's sample
        (``Request.commit``: stop checks, first-token time, each token's ``logprobs``), then to
        the sequence. A sample that stops leaves at once, its blocks freed this step. A beam's
        tokens are the search's state; they reach the request when the search ends
        (``finish_group``)."""
        if beam:
            seq.token_ids += tokens
            return
        landed, reason = seq.request.commit(seq.sample_id, tokens, self.eos_ids,
                                            self.max_model_len, logprobs=logprobs)
        seq.token_ids += tokens[:landed]
        if reason is not None:
            group = self.groups[seq.request.request_id]
            group.seqs.remove(seq)
            group.done_seqs.append(seq)
            seq.finish_reason = reason
            self.allocator.free(seq)

    def finish_group(self, group: SequenceGroup, reason: FinishReason | None = None) -> Request:
        """End a request: free its blocks and record its samples, best first (beams by score,
        parallel samples in order). ``reason`` (an abort) also ends the sequences still running,
        which keep their partial tokens."""
        req, beams = group.request, group.request.params.beam_width > 1
        for seq in group.seqs:
            seq.finish_reason = reason
            if beams:   # a running beam is ranked like a finished hypothesis: length-normalized
                seq.cum_logprob /= max(1, len(seq.output_token_ids))
        done = group.done_seqs + group.seqs
        self.finish(group)
        done.sort(key=(lambda s: -s.cum_logprob) if beams else (lambda s: s.sample_id))
        req.set_final([(list(s.output_token_ids), s.finish_reason,
                        req.sample_logprobs(s.sample_id)) for s in done])
        req.finish(reason or done[0].finish_reason)
        del self.groups[req.request_id]
        return req
