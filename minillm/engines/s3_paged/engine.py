"""Step 3 — the paged engine: block manager + scheduler + our own forward (notebook 03).

One step: ``Scheduler.schedule`` picks (sequence, tokens) pairs within the token budget and
reserves their KV slots -> ``ModelRunner.run`` does copy-on-write copies and one forward over all
of them -> ``_postprocess`` samples a token for every sequence that reached its end, forks for
n > 1 and beam search, finishes and frees what is done.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from ...memory import KVUsage, MemorySnapshot
from ...request import FinishReason, Request, RequestError, check_int, stop_reason
from ...sampling import sample_tokens
from ..base import Engine, StepOutput
from .attention import TorchAttention
from .block_manager import BlockManager, blocks_for_request
from .runner import ModelRunner
from .scheduler import Scheduler, SequenceGroup
from .sequence import Sequence

DEFAULT_KV_CACHE_BYTES = 1 << 30


def get_attention_backend(name: str | None, device: torch.device):
    """``torch`` (reference) or ``triton`` (step 4); default triton on CUDA when it is installed,
    torch otherwise. Asking for triton where it cannot run raises ``TritonUnavailableError``."""
    if name is None:
        from ..s4_triton import triton_available
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from ..s4_triton import TritonAttention  # sets TRITON_INTERPRET=1 on CPU first
        return TritonAttention()
    raise ValueError(f"unknown attention_backend {name!r}: choose 'torch' or 'triton'")


class PagedEngine(Engine):
    name = "paged"
    supports_abort = True

    def __init__(self, model, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, max_num_batched_tokens: int = 1024,
                 max_num_seqs: int = 64, enable_prefix_caching: bool = False,
                 policy: str = "fcfs", attention_backend: str | None = None):
        super().__init__(model)
        block_size = check_int("block_size", block_size, 1)
        max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got "
                             f"{enable_prefix_caching!r}")
        num_blocks = self.pool_size(block_size, num_blocks, kv_cache_bytes, max_num_seqs)
        self.block_size = block_size
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_batched_tokens, max_num_seqs, policy)
        self.backend = get_attention_backend(attention_backend, model.device)
        self.runner = ModelRunner(model, num_blocks, block_size, self.backend)
        self.groups: dict[str, SequenceGroup] = {}
        self.num_arrived = 0
        self.aborted: list[Request] = []

    def pool_size(self, block_size: int, num_blocks: int | None, kv_cache_bytes: int | None,
                  max_num_seqs: int) -> int:
        """Blocks in the pool: given directly, or as many as a byte budget holds (default 1 GiB,
        but no more than every sequence at full length could use)."""
        if num_blocks is not None:
            return check_int("num_blocks", num_blocks, 1)
        block_bytes = block_size * self.model.kv_bytes_per_token
        if kv_cache_bytes is None:
            n = DEFAULT_KV_CACHE_BYTES // block_bytes
            return int(min(n, max_num_seqs * -(-self.max_model_len // block_size)))
        kv_cache_bytes = check_int("kv_cache_bytes", kv_cache_bytes, 1)
        if kv_cache_bytes < block_bytes:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} is smaller than one block "
                             f"({block_bytes} bytes)")
        return kv_cache_bytes // block_bytes

    # --- requests ---------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        super().validate(req)
        p, bs = req.params, self.block_size
        width = max(p.n, p.beam_width)
        longest = min(req.prompt_len + p.max_tokens, self.max_model_len)
        need = blocks_for_request(req.prompt_len, longest - req.prompt_len, width, bs)
        pool = self.block_manager.num_blocks
        if need > pool:
            raise RequestError(f"{req.request_id}: needs {need} KV blocks of {bs} tokens "
                               f"(prompt {req.prompt_len} + max_tokens {p.max_tokens}), but the "
                               f"whole pool has {pool}; it could never run")
        if width > self.scheduler.max_num_batched_tokens:
            raise RequestError(f"{req.request_id}: n/beam_width {width} exceeds "
                               f"max_num_batched_tokens {self.scheduler.max_num_batched_tokens}")

    def add_request(self, req: Request) -> None:
        if req.request_id in self.groups:
            raise RequestError(f"{req.request_id}: a request with this id is already in flight")
        seq = Sequence(req, list(req.prompt_token_ids), req.prompt_len)
        group = SequenceGroup(req, [seq], self.num_arrived)
        self.num_arrived += 1
        self.groups[req.request_id] = group
        self.scheduler.add(group)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.aborted)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def abort(self, request_id: str) -> bool:
        """Cancel a request now: its blocks go back to the pool at once; every sample keeps the
        tokens it has so far."""
        group = self.groups.get(request_id)
        if group is None or group.request.finished:
            return False
        self.aborted.append(self._finish_group(group, FinishReason.ABORT))
        return True

    def reset(self) -> list[Request]:
        dropped = [self._finish_group(g, FinishReason.ABORT) for g in list(self.groups.values())]
        dropped += self.aborted
        self.aborted = []
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        bm = self.block_manager
        if bm.num_free_blocks != bm.num_blocks:   # interrupted between a fork and its commit
            bm.release_all()
        return dropped

    # --- one step ---------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput(finished=self.aborted)
        self.aborted = []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if not self.scheduler.running and self.scheduler.waiting and not out.finished:
                raise RuntimeError("scheduler made no progress with an empty pool (a bug)")
            return out
        t = time.perf_counter()
        self.runner.copy_blocks(sched.copies)
        seqs, logits = self.runner.run(sched.scheduled)
        ms = (time.perf_counter() - t) * 1000.0
        # A mixed step's forward time is split between prefill and decode by token count.
        n_dec = sum(1 for s, n in sched.scheduled if n == 1 and s.num_computed_tokens >= s.prompt_len)
        n_pre = sched.num_tokens - n_dec
        out.prefill_ms, out.decode_ms = ms * n_pre / sched.num_tokens, ms * n_dec / sched.num_tokens
        out.num_prefill_tokens, out.num_decode_tokens = n_pre, n_dec
        out.batch_size = len(sched.scheduled)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        self._postprocess(seqs, logits, out)
        return out

    def _postprocess(self, seqs: list[Sequence], logits: torch.Tensor, out: StepOutput) -> None:
        by_group: dict[int, list[int]] = {}
        for i, seq in enumerate(seqs):
            by_group.setdefault(id(self.groups[seq.request.request_id]), []).append(i)
        simple = [i for i, s in enumerate(seqs) if s.request.params.beam_width == 1]
        if simple:
            self._sample(simple, seqs, logits)
        for i, seq in enumerate(seqs):
            if seq.request.params.beam_width > 1:
                seq.pending_logprobs = torch.log_softmax(logits[i].float(), dim=-1)
        for idxs in by_group.values():
            group = self.groups[seqs[idxs[0]].request.request_id]
            if group.request.params.beam_width > 1:
                self._beam_step(group)
            if not group.seqs:
                out.finished.append(self._finish_group(group))

    def _sample(self, rows: list[int], seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample for plain sequences; the first token of an n > 1 request forks the prompt."""
        expanded = []   # (row, seq) pairs, one per sample to draw
        for i in rows:
            seq = seqs[i]
            group = self.groups[seq.request.request_id]
            expanded += [(i, child) for child in group.fork_samples(seq, self.block_manager)]
            expanded.append((i, seq))
        params = [s.request.params for _, s in expanded]
        tokens = sample_tokens(logits[[i for i, _ in expanded]], params,
                               [len(s.output_token_ids) for _, s in expanded],
                               [s.sample_id for _, s in expanded])
        for (_, seq), tok in zip(expanded, tokens):
            self._append(seq, tok)

    def _append(self, seq: Sequence, token: int) -> None:
        req = seq.request
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        seq.token_ids.append(token)
        if req.params.n == 1:   # keep the request's own view live (progress, abort, notebooks)
            req.output_token_ids.append(token)
        reason = stop_reason(req.params, token, len(seq.output_token_ids), seq.num_tokens,
                             self.eos_ids, self.max_model_len)
        if reason is not None:
            self._retire(seq, reason)

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        """A finished sample leaves at once: its blocks are free for others this very step."""
        group = self.groups[seq.request.request_id]
        group.seqs.remove(seq)
        group.done_seqs.append(seq)
        seq.finish_reason = reason
        self.block_manager.free(seq)

    def _beam_step(self, group: SequenceGroup) -> None:
        """Beam search: keep the beam_width best continuations of all beams (HF semantics with
        length_penalty=1, early_stopping=False). Beams that continue from the same parent fork it,
        sharing its blocks; parents no child continues from are freed."""
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
            is_stop = (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids
            if is_stop:
                if rank < width:
                    self._add_hypothesis(group, parent.token_ids + [tok], score / gen_len,
                                         parent.prompt_len, FinishReason.STOP)
            elif len(chosen) < width:
                chosen.append((parent, tok, score))
        at_length = gen_len >= p.max_tokens or beams[0].num_tokens + 1 >= self.max_model_len
        best_running = chosen[0][2] / gen_len if chosen else float("-inf")
        done = at_length or not chosen or (
            len(group.done_seqs) >= width and min(s.cum_logprob for s in group.done_seqs) >= best_running)
        # Fork before any token is appended: a child must copy its parent's pre-step state.
        claimed: set[int] = set()
        new_beams = []
        for parent, tok, score in chosen:
            seq = parent if id(parent) not in claimed else self.block_manager.fork(parent)
            claimed.add(id(parent))
            new_beams.append((seq, tok, score))
        for b in beams:
            b.pending_logprobs = None
            if id(b) not in claimed:
                self.block_manager.free(b)
        group.seqs = []
        for seq, tok, score in new_beams:
            seq.token_ids.append(tok)
            seq.cum_logprob = score
            if done:
                self._add_hypothesis(group, seq.token_ids, score / gen_len, seq.prompt_len,
                                     FinishReason.LENGTH)
                self.block_manager.free(seq)
            else:
                group.seqs.append(seq)
        if group.request.first_token_time is None:
            group.request.first_token_time = time.perf_counter()
        if done:
            group.seqs = []

    def _add_hypothesis(self, group: SequenceGroup, tokens: list[int], score: float,
                        prompt_len: int, reason: FinishReason) -> None:
        hyp = Sequence(group.request, list(tokens), prompt_len, cum_logprob=score)
        hyp.finish_reason = reason
        group.done_seqs.append(hyp)
        group.done_seqs.sort(key=lambda s: -s.cum_logprob)
        del group.done_seqs[group.request.params.beam_width:]

    def _finish_group(self, group: SequenceGroup, reason: FinishReason | None = None) -> Request:
        """End a request: free its blocks and record its samples, best first (beams by score,
        parallel samples in order). ``reason`` (an abort) also ends the sequences still running,
        which keep their partial tokens."""
        req = group.request
        for seq in group.seqs:
            seq.finish_reason = reason
            seq.cum_logprob /= max(1, len(seq.output_token_ids))   # as a finished hypothesis
        done = group.done_seqs + group.seqs
        self.scheduler.finish(group)
        if req.params.beam_width > 1:
            done.sort(key=lambda s: -s.cum_logprob)
        else:
            done.sort(key=lambda s: s.sample_id)
        req.samples = [list(s.output_token_ids) for s in done]
        req.output_token_ids = list(req.samples[0])
        req.finish(reason or done[0].finish_reason)
        del self.groups[req.request_id]
        return req

    # --- memory -----------------------------------------------------------------------------------
    def _live_seqs(self) -> list[Sequence]:
        return [s for g in self.scheduler.running + self.scheduler.waiting for s in g.seqs
                if s.block_table]

    def kv_usage(self) -> KVUsage:
        st = self.block_manager.stats(self._live_seqs())
        return KVUsage(st.allocated_slots, st.token_slots, st.num_blocks * self.block_size,
                       self.model.kv_bytes_per_token)

    def snapshot(self) -> MemorySnapshot:
        return self.block_manager.snapshot(self._live_seqs(), self.name, self.step_count,
                                           self.model.kv_bytes_per_token)
