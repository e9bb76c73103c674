"""Rung 6 — ``SpeculativeEngine``: the paged engine, guessing ahead (notebook 06).

This rung is the paged engine's step with its two extension points filled in:
``propose`` — the proposer guesses up to k tokens for each decoding sequence
(``Sequence.spec_token_ids``), and ``Scheduler.schedule`` plans the step as always, a speculating
sequence simply having 1 + k tokens to compute (its slots reserved like any tokens; guesses the
budget has no room for are dropped) beside ordinary decodes and prefill chunks -> one forward
returns logits for all 1 + k positions of each speculating sequence -> ``verify`` — the acceptance
rule keeps a prefix of the guesses plus the target's own next token -> ``Scheduler.update_from_output``
commits them and gives back the slots of the rejected ones at once (``BlockManager.truncate``).

Only n = 1 requests without beam search speculate (greedy and sampled): n > 1 samples and beams
decode normally in the same batches. Greedy and seeded output is token for token the paged engine's,
whatever the batch, the pool or a preemption (a seeded token depends on its seed, sample and index
only); unseeded sampled output follows the same distribution (``rejection.py``).
"""
from __future__ import annotations

import time

import torch

from ...core.engine import PagedEngine
from ...core.scheduler import SchedulerOutput
from ...core.sequence import Sequence
from ...request import Request, SpecStats, stop_reason
from ...sampling_params import CONTROL_FIELDS, LOGPROB_FIELDS
from ...structured import NO_TOKEN, mask_guessed_rows, row_matcher
from .config import SpeculativeConfig
from .proposers import DraftModelProposer, NgramProposer, Proposer
from .rejection import accept
from .trace import Verification


class SpeculativeEngine(PagedEngine):
    name = "paged+spec"
    configs = PagedEngine.configs + (SpeculativeConfig,)
    # verify() judges guesses by the raw distribution (but for a grammar's mask, applied per
    # guessed position: ``_verify``); the sampler's controls and logprobs would need the same
    # per position (not done here)
    refuses = frozenset(CONTROL_FIELDS + LOGPROB_FIELDS)

    def __init__(self, model, *, proposer: Proposer | None = None, **options):
        """``options``: the paged engine's and ``SpeculativeConfig``'s, flat:
        ``speculative="ngram"`` or ``"draft"`` with the options beside it, or
        ``speculative=SpeculativeConfig(...)`` (which then wins). ``proposer`` replaces the
        proposer it builds."""
        super().__init__(model, **options)
        cfg = self.speculative_config
        self.name = f"paged+{cfg.method}"
        if proposer is None and cfg.method == "ngram":
            proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        elif proposer is None:
            proposer = DraftModelProposer(self.runner, cfg.layers_for(len(self.runner.net.layers)),
                                          self.block_manager.num_blocks)
        self.proposer = proposer
        self.run_stats = SpecStats()     # this run's totals (``run_extra`` reports them)

    # --- proposing --------------------------------------------------------------------------------
    def _budget(self, seq: Sequence) -> int:
        """How many guesses ``seq`` may get now: 0 unless it is decoding an n = 1 request; never
        past max_tokens or the model's context (so a request that fits the pool alone still does)."""
        p = seq.request.params
        if p.n > 1 or p.beam_width > 1 or seq.num_uncomputed != 1 or seq.finish_reason:
            return 0
        return max(0, min(self.speculative_config.num_speculative_tokens,
                          p.max_tokens - len(seq.output_token_ids) - 1,
                          self.max_model_len - 1 - seq.num_tokens))

    def propose(self) -> None:
        """Guess up to k tokens for each decoding sequence (``Sequence.spec_token_ids``): the
        scheduler then plans 1 + k tokens for it (``schedule_step`` trims those it gave no slots)."""
        t = time.perf_counter()
        for group in self.scheduler.running:
            for seq in group.seqs:
                seq.spec_token_ids = []
        seqs = [g.seqs[0] for g in self.scheduler.running if len(g.seqs) == 1]
        ks = [self._budget(s) for s in seqs]
        seqs, ks = [s for s, k in zip(seqs, ks) if k > 0], [k for k in ks if k > 0]
        guesses = self.proposer.propose(seqs, ks) if seqs else []
        for seq, g, k in zip(seqs, guesses, ks):
            seq.spec_token_ids = list(g[:k])
        self._propose_ms = (time.perf_counter() - t) * 1000.0
        self._proposed_at = time.perf_counter()
        self.run_stats.propose_ms += self._propose_ms

    def schedule_step(self) -> SchedulerOutput:
        """The scheduler's plan; then each sequence keeps the guesses it got slots for beyond its
        newest token: all, fewer when the budget ran short, none if it was not scheduled (still
        waiting, or preempted). Guesses were never part of its tokens: dropping them undoes
        nothing."""
        sched = super().schedule_step()
        planned = {seq: n for seq, n in sched.scheduled}
        for group in self.scheduler.running + sched.preempted:   # where guessers can be now
            for seq in group.seqs:
                if seq.spec_token_ids:
                    del seq.spec_token_ids[max(0, planned.get(seq, 0) - 1):]
        return sched

    # --- verifying --------------------------------------------------------------------------------
    def verify(self, lookahead: dict[Sequence, torch.Tensor]) -> dict[Sequence, list[int]]:
        """For each sequence with guesses, the tokens it keeps: the acceptance rule over its 1 + k
        rows of logits (``rejection.py``), cut after a token that ends the request. Observers
        receive each as a ``Verification`` (notebook 06 draws them: ``trace.SpecTrace``)."""
        accepted = {seq: self._verify(seq, rows) for seq, rows in lookahead.items()}
        verify_ms = (time.perf_counter() - self._proposed_at) * 1000.0
        for seq in lookahead:
            seq.request.spec.propose_ms += self._propose_ms
            seq.request.spec.verify_ms += verify_ms
        self.run_stats.verify_ms += verify_ms
        return accepted

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        guesses, n_before = seq.spec_token_ids, seq.num_tokens
        matcher = row_matcher(seq.request, seq.sample_id)
        # structured output: each row masked as plain decoding would; a grammar that allows no
        # token here gets no draw (NO_TOKEN fails its request at the commit)
        dead = matcher is not None and mask_guessed_rows(logits, matcher, guesses)
        kept = [NO_TOKEN] if dead else accept(guesses, self.proposer.proposal_probs(seq), logits,
                                              seq.request.params, n_before - seq.prompt_len,
                                              seq.sample_id)
        kept = self._until_stop(seq, kept, n_before)
        accepted = next((i for i, (a, b) in enumerate(zip(kept, guesses)) if a != b),
                        min(len(kept), len(guesses)))
        if self.observers.wants("verified"):
            self.observers.emit("verified", seq.request.request_id,
                                Verification(n_before, tuple(guesses), tuple(kept), accepted))
        self._count(seq.request, SpecStats(1, len(guesses), accepted, len(kept)))
        return kept

    def _until_stop(self, seq: Sequence, kept: list[int], n_before: int) -> list[int]:
        """Cut the kept tokens after the first that ends the request (EOS, stop id, length)."""
        p = seq.request.params
        for i, token in enumerate(kept):
            if stop_reason(p, token, n_before + i + 1 - seq.prompt_len, n_before + i + 1,
                           self.eos_ids, self.max_model_len) is not None:
                return kept[:i + 1]
        return kept

    def _count(self, req: Request, stats: SpecStats) -> None:
        if req.spec is None:
            req.spec = SpecStats()
        req.spec.add(stats)
        self.run_stats.add(SpecStats(stats.num_steps, stats.num_proposed, stats.num_accepted,
                                     stats.num_emitted))

    # --- runs -------------------------------------------------------------------------------------
    def begin_run(self) -> None:
        super().begin_run()
        self.run_stats = SpecStats()

    def run_extra(self) -> dict:
        """This run's speculation totals, as ``metrics.extra["speculative"]``."""
        return {"speculative": {"method": self.speculative_config.method,
                                "k": self.speculative_config.num_speculative_tokens,
                                **self.run_stats.as_dict()}}

    def reset(self) -> list[Request]:
        dropped = super().reset()
        self.proposer.reset()
        return dropped
