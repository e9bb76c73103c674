"""Rung 6 — ``SpeculativeEngine``: the paged engine, guessing ahead (notebook 06).

One step: the proposer guesses up to k tokens for each decoding sequence and they are appended to
its tokens for the moment -> ``Scheduler.schedule`` plans the step as always, so a speculating
sequence simply has 1 + k tokens to compute (its slots reserved like any tokens) beside ordinary
decodes and prefill chunks -> one forward returns logits for all k + 1 positions of each
speculating sequence -> the acceptance rule keeps a prefix of the guesses plus the target's own
next token -> ``BlockManager.truncate`` gives back the slots of the rejected ones at once.

Only n = 1 requests without beam search speculate (greedy and sampled): n > 1 samples and beams
decode normally in the same batches. Greedy and seeded output is token for token the paged engine's,
whatever the batch, the pool or a preemption (a seeded token depends on its seed, sample and index
only); unseeded sampled output follows the same distribution (``rejection.py``).
"""
from __future__ import annotations

import time

from ...request import Request, SpecStats, stop_reason
from ..base import StepOutput
from ...core.engine import PagedEngine
from ...core.scheduler import SchedulerOutput
from ...core.sequence import Sequence
from .config import SpeculativeConfig
from .proposers import DraftModelProposer, NgramProposer, Proposer
from .rejection import accept
from .runner import VerifyRunner


class SpeculativeEngine(PagedEngine):
    name = "paged+spec"
    configs = PagedEngine.configs + (SpeculativeConfig,)

    def __init__(self, model, *, proposer: Proposer | None = None, **options):
        """``options``: the paged engine's and ``SpeculativeConfig``'s, flat:
        ``speculative="ngram"`` or ``"draft"`` with the options beside it, or
        ``speculative=SpeculativeConfig(...)`` (which then wins). ``proposer`` replaces the
        proposer it builds."""
        super().__init__(model, **options)
        cfg = self.config = self.speculative_config   # (frozen: one object, two names)
        self.name = f"paged+{cfg.method}"
        if proposer is None and cfg.method == "ngram":
            proposer = NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        elif proposer is None:
            proposer = DraftModelProposer(self.runner, cfg.layers_for(len(self.runner.net.layers)),
                                          self.block_manager.num_blocks)
        self.proposer = proposer
        self.run_stats = SpecStats()     # this run's totals (``run`` reports them)
        # Notebook 06: set ``trace = []`` to record each verification (guesses, kept tokens) and,
        # in ``verify_snapshots``, the pool at each step's fullest (before the rollback).
        self.trace: list[dict] | None = None
        self.verify_snapshots: list = []

    def make_runner(self, num_blocks: int, block_size: int, backend) -> VerifyRunner:
        """The paged runner, laying verifications out as batched decode rows."""
        return VerifyRunner(self.model, num_blocks, block_size, backend)

    # --- proposing --------------------------------------------------------------------------------
    def _budget(self, seq: Sequence) -> int:
        """How many guesses ``seq`` may get now: 0 unless it is decoding an n = 1 request; never
        past max_tokens or the model's context (so a request that fits the pool alone still does)."""
        p = seq.request.params
        if p.n > 1 or p.beam_width > 1 or seq.num_uncomputed != 1 or seq.finish_reason:
            return 0
        return max(0, min(self.config.num_speculative_tokens,
                          p.max_tokens - len(seq.output_token_ids) - 1,
                          self.max_model_len - 1 - seq.num_tokens))

    def _propose(self) -> dict[Sequence, list[int]]:
        seqs = [g.seqs[0] for g in self.scheduler.running if len(g.seqs) == 1]
        ks = [self._budget(s) for s in seqs]
        seqs, ks = [s for s, k in zip(seqs, ks) if k > 0], [k for k in ks if k > 0]
        guesses = self.proposer.propose(seqs, ks) if seqs else []
        props = {s: g[:k] for s, g, k in zip(seqs, guesses, ks) if g}
        for seq, g in props.items():
            seq.token_ids += g           # for now: the scheduler sees 1 + k tokens to compute
        return props

    @staticmethod
    def _strip(seq: Sequence, guesses: list[int]) -> None:
        del seq.token_ids[len(seq.token_ids) - len(guesses):]

    def _fit(self, props: dict[Sequence, list[int]], sched: SchedulerOutput) -> dict:
        """Keep the guesses the scheduler gave slots to: all of them, fewer when the token budget
        ran out, none for a sequence not scheduled (waiting, or preempted to make room)."""
        planned = {id(s): n for s, n in sched.scheduled}
        kept = {}
        for seq, g in props.items():
            n = planned.get(id(seq), 0)
            self._strip(seq, g[max(0, n - 1):])
            if n > 1:
                kept[seq] = g[:n - 1]
        return kept

    # --- one step ---------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput(finished=self.aborted)
        self.aborted = []
        t0 = time.perf_counter()
        props = self._propose()
        propose_ms = (time.perf_counter() - t0) * 1000.0
        try:
            sched = self.scheduler.schedule()
            props = self._fit(props, sched)
            if not sched.scheduled:
                if not self.scheduler.running and self.scheduler.waiting and not out.finished:
                    raise RuntimeError("scheduler made no progress with an empty pool (a bug)")
                return out
            t1 = time.perf_counter()
            self.runner.copy_blocks(sched.copies)
            self.runner.verify_ids = {s.seq_id for s in props}
            reached, logits = self.runner.run(sched.scheduled,
                                              {s.seq_id: len(g) + 1 for s, g in props.items()})
        except BaseException:        # never leave guesses behind in a sequence's tokens
            for seq, g in props.items():
                if seq.token_ids[-len(g):] == g:
                    self._strip(seq, g)
            raise
        self._account(out, sched, props, (time.perf_counter() - t1) * 1000.0)
        plain, spec, r = [], {}, 0
        for seq in reached:              # rows: one per plain sequence, k + 1 per speculating one
            if seq in props:
                spec[seq] = logits[r:r + len(props[seq]) + 1]
                r += len(props[seq]) + 1
            else:
                plain.append(r)
                r += 1
        self.scheduler.commit_computed(SchedulerOutput(
            [(s, n) for s, n in sched.scheduled if s not in props], [], []))
        tokens, beams = self.sampler(logits[plain], self.scheduler.rows_to_sample(
            [s for s in reached if s not in props]))
        for seq, g in props.items():     # the guesses' K/V are written: the pool at its fullest
            seq.num_computed_tokens += len(g) + 1
        if self.trace is not None:
            self.verify_snapshots.append(self.snapshot())
        for seq, rows in spec.items():
            tokens.append((seq, self._verify(seq, props[seq], rows)))
        verify_ms = (time.perf_counter() - t1) * 1000.0
        for seq, g in props.items():
            self._bill(seq.request, propose_ms, verify_ms)
        self.run_stats.propose_ms += propose_ms
        self.run_stats.verify_ms += verify_ms if props else 0.0
        out.finished += self.scheduler.postprocess(tokens, beams)
        return out

    def _verify(self, seq: Sequence, guesses: list[int], logits) -> int:
        """Apply the acceptance rule, roll back, append all kept tokens but the last; return the
        last (``Scheduler.postprocess`` appends it and finishes the request if it stops)."""
        n_before = seq.num_tokens - len(guesses)            # tokens before this step's guesses
        first_index = n_before - seq.prompt_len
        kept = accept(guesses, self.proposer.proposal_probs(seq), logits, seq.request.params,
                      first_index, seq.sample_id)
        kept = self._until_stop(seq, kept, n_before)
        accepted = next((i for i, (a, b) in enumerate(zip(kept, guesses)) if a != b),
                        min(len(kept), len(guesses)))
        stats = SpecStats(1, len(guesses), accepted, len(kept))
        self._strip(seq, guesses)
        # K/V written up to the last guess; keep only that of the newest token and kept guesses
        self.block_manager.truncate(seq, n_before + len(kept) - 1)
        if self.trace is not None:
            self.trace.append({"step": self.total_steps + 1, "request_id": seq.request.request_id,
                               "context": n_before, "guesses": list(guesses),
                               "kept": list(kept), "num_accepted": stats.num_accepted})
        req = seq.request
        for token in kept[:-1]:
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            seq.token_ids.append(token)
            req.output_token_ids.append(token)
        self.block_manager.cache_full_blocks(seq)      # full blocks of kept tokens only
        self._count(req, stats)
        return kept[-1]

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

    @staticmethod
    def _bill(req: Request, propose_ms: float, verify_ms: float) -> None:
        req.spec.propose_ms += propose_ms
        req.spec.verify_ms += verify_ms

    @staticmethod
    def _account(out: StepOutput, sched: SchedulerOutput, props: dict, ms: float) -> None:
        """Like the paged engine's split, with a speculating sequence's 1 + k tokens counted as
        decode: they produce output tokens, not a prompt."""
        n_all = sched.num_tokens
        n_dec = sum(n for s, n in sched.scheduled
                    if s in props or (n == 1 and s.num_computed_tokens >= s.prompt_len))
        out.prefill_ms, out.decode_ms = ms * (n_all - n_dec) / n_all, ms * n_dec / n_all
        out.num_prefill_tokens, out.num_decode_tokens = n_all - n_dec, n_dec
        out.batch_size = len(sched.scheduled)

    # --- runs -------------------------------------------------------------------------------------
    def run(self, requests, on_step=None, progress=False, on_output=None):
        """``Engine.run``, with this run's speculation totals in ``metrics.extra["speculative"]``."""
        self.run_stats = SpecStats()
        result = super().run(requests, on_step, progress, on_output)
        result.metrics.extra["speculative"] = {"method": self.config.method,
                                               "k": self.config.num_speculative_tokens,
                                               **self.run_stats.as_dict()}
        return result

    def reset(self) -> list[Request]:
        dropped = super().reset()
        self.proposer.reset()
        return dropped
