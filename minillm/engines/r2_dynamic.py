"""Rung 2 — dynamic (continuous) batching on a padded KV rectangle.

Scheduling happens at every *iteration*, not every batch (Orca's idea): a request that finishes
leaves at once, and waiting requests are prefilled and join the running batch at the next step.
Nobody waits for the longest request any more. (Notebook 02_dynamic_batching.)

What has not changed is memory: every layer keeps K and V as one contiguous rectangle
``[rows, kv_heads, width, head_dim]``, because the attention kernel wants each sequence's KV in one
piece. So:

* a newcomer is right-aligned with the others and left-padded to the rectangle's width, even when
  its prompt is short and the width comes from a long-running neighbour;
* a finished request leaves a *hole* (a row of dead memory) until a newcomer takes the row, or
  the rectangle is compacted, which means copying the whole cache;
* columns are freed only when every row is padding there (when the longest request leaves).

Those holes and that padding are the waste that rung 3's paged KV cache removes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..runtime.config import option, set_checked
from ..request import FinishReason, Request
from ..sampling import sample_next_tokens
from ..runtime.interface import StepOutput, timed_ms
from .base import ContiguousEngine
from .padded import PaddedKV, hf_forward, left_pad


@dataclass(frozen=True)
class DynamicConfig:
    max_num_seqs: int = option(32, "dynamic: max concurrent requests (rows of the rectangle)")

    def __post_init__(self):
        set_checked(self, "max_num_seqs")


class DynamicBatchEngine(ContiguousEngine):
    name = "dynamic"
    supports_abort = True
    configs = (DynamicConfig,)

    def __init__(self, model, **options):
        """``options``: ``DynamicConfig``'s (``max_num_seqs=32``)."""
        super().__init__(model, **options)
        self.max_num_seqs = self.dynamic_config.max_num_seqs
        self.waiting: deque[Request] = deque()
        self.rows: list[Request | None] = []   # row r of the rectangle; None = a hole
        self.kv: PaddedKV | None = None
        self.aborted: list[Request] = []

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.num_running() > 0 or bool(self.aborted)

    def num_running(self) -> int:
        return sum(r is not None for r in self.rows)

    @torch.inference_mode()   # the mask was made in inference mode; only there may it change
    def abort(self, request_id: str) -> bool:
        """Cancel a request: it leaves its row (a hole) and ends with finish reason ``abort``."""
        for i, r in enumerate(self.rows):
            if r is not None and r.request_id == request_id:
                self.rows[i] = None
                self.kv.mask[i] = False
                return self._aborted(r)
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                return self._aborted(r)
        return False

    def reset(self) -> list[Request]:
        dropped = [r for r in self.rows if r is not None and not r.finished] + list(self.waiting)
        for r in dropped:
            r.finish(FinishReason.ABORT)
        dropped += self.aborted
        self.waiting.clear()
        self.rows, self.kv, self.aborted = [], None, []
        return dropped

    def _aborted(self, req: Request) -> bool:
        req.finish(FinishReason.ABORT)
        self.aborted.append(req)
        return True

    @torch.inference_mode()
    def _step(self) -> StepOutput:
        out = StepOutput(finished=self.aborted)
        self.aborted = []
        self._admit(out)          # newcomers: prefill, then take holes or new rows
        self._compact()           # holes nobody took are dropped before we compute on them
        if self.num_running():
            self._decode(out)
        for i, r in enumerate(self.rows):
            if r is not None and r.finished:
                self.rows[i] = None      # leaves at once; its row is a hole until reused
                self.kv.mask[i] = False
        if self.kv is not None:
            self.kv.trim_left()
        return out

    def _admit(self, out: StepOutput) -> None:
        """Join: prefill as many waiting requests as there are free rows, together in one left-padded
        batch (``left_pad`` + ``hf_forward``), and sample each one's first token. Those not already
        done take the holes first, then new rows; their KV is merged into the rectangle
        (``PaddedKV.merge``). A request done after its first token never joins."""
        free = self.max_num_seqs - self.num_running()
        if not self.waiting or free <= 0:
            return
        new = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        ids, mask = left_pad([r.prompt_token_ids for r in new], self.model.pad_token_id,
                             self.model.device)
        cache = DynamicCache()
        logits, ms = timed_ms(hf_forward, self.model.hf_model, ids, mask, cache)
        out.prefill_ms += ms
        out.num_prefill_tokens += int(mask.sum())
        tokens = sample_next_tokens(logits, new, self.eos_ids)
        joined = PaddedKV(cache, mask)
        keep = []
        for i, (req, tok) in enumerate(zip(new, tokens)):
            if req.append_token(tok, self.eos_ids, self.max_model_len):
                out.finished.append(req)   # done after one token: never joins the batch
            else:
                keep.append(i)
        if not keep:
            return
        joined.select_rows(keep)
        holes = [i for i, r in enumerate(self.rows) if r is None]
        slots = (holes + list(range(len(self.rows), len(self.rows) + len(keep))))[:len(keep)]
        if self.kv is None:
            self.kv, self.rows = joined, []
        else:
            self.kv.merge(joined, slots)
        for i, s in zip(keep, slots):
            if s < len(self.rows):
                self.rows[s] = new[i]
            else:
                self.rows.append(new[i])

    def _compact(self) -> None:
        """Leave: drop the rows of requests that left (``None`` in ``self.rows``) from the row list
        *and* from the KV rectangle (``PaddedKV.select_rows``), so nothing more is computed for
        them. With no request left, the rectangle goes too."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        if len(live) == len(self.rows):
            return
        if not live:
            self.rows, self.kv = [], None
            return
        self.kv.select_rows(live)
        self.rows = [self.rows[i] for i in live]

    def _decode(self, out: StepOutput) -> None:
        reqs: list[Request] = self.rows  # after _compact every row is live
        ids = torch.tensor([r.output_token_ids[-1] for r in reqs], device=self.model.device)[:, None]
        positions = self.kv.mask.sum(1, keepdim=True)           # real tokens before the new one
        mask = torch.cat([self.kv.mask, torch.ones_like(self.kv.mask[:, :1])], dim=1)
        logits, ms = timed_ms(hf_forward, self.model.hf_model, ids, mask.long(), self.kv.cache,
                              positions)
        self.kv.mask = mask
        out.decode_ms += ms
        out.batch_size = len(reqs)
        out.num_decode_tokens += len(reqs)
        for req, tok in zip(reqs, sample_next_tokens(logits, reqs, self.eos_ids)):
            if req.append_token(tok, self.eos_ids, self.max_model_len):
                out.finished.append(req)

    # --- memory: the rectangle as it really is, holes and padding included ---------------------
    def _rows(self):
        if self.kv is None:
            return [], 0
        lens = self.kv.mask.sum(1).tolist()
        width = self.kv.width
        rows = [None if r is None else (r.request_id, width - n, n, 0)
                for r, n in zip(self.rows, lens)]
        return rows, width
