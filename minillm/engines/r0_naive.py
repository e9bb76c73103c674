"""Rung 0 — the naive loop: one request at a time, one token per forward pass.

Two variants (notebook 00_naive_loop):

* ``naive-nocache``: every step re-runs the *whole* sequence through the model and keeps only the
  last position's logits. Generating n tokens costs 1 + 2 + ... + n positions: O(n^2) work.
* ``naive``: the first step (prefill) runs the prompt once and keeps every layer's keys and values
  (the KV cache, ``past_key_values``); each later step (decode) feeds only the newest token and
  attends to the cache: O(n) work, paid for with KV memory that grows by one slot per token.

Neither batches: the GPU (or here, the CPU's matrix units) sees one sequence at a time, so the
weights are re-read from memory for every single token. That is what later steps fix.
"""
from __future__ import annotations

from collections import deque

import torch
from transformers import DynamicCache

from ..request import FinishReason, Request
from ..sampling import sample_next_tokens
from ..runtime.interface import StepOutput, timed_ms
from .base import ContiguousEngine


class NaiveEngine(ContiguousEngine):
    """One request at a time through the Hugging Face model, with or without its KV cache."""

    serves_one_at_a_time = True

    def __init__(self, model, use_cache: bool = True):
        super().__init__(model)
        self.use_cache = use_cache
        self.name = "naive" if use_cache else "naive-nocache"
        self.waiting: deque[Request] = deque()
        self.current: Request | None = None
        self.cache: DynamicCache | None = None

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return self.current is not None or bool(self.waiting)

    def num_running(self) -> int:
        return int(self.current is not None)

    def reset(self) -> list[Request]:
        dropped = ([self.current] if self.current is not None else []) + list(self.waiting)
        for r in dropped:
            r.finish(FinishReason.ABORT)
        self.waiting.clear()
        self.current = self.cache = None
        return dropped

    @torch.inference_mode()
    def _step(self) -> StepOutput:
        prefill = self.current is None
        if prefill:
            self.current, self.cache = self.waiting.popleft(), DynamicCache()
        req = self.current
        if prefill or not self.use_cache:
            ids = req.all_token_ids          # the whole sequence, every time without a cache
        else:
            ids = req.output_token_ids[-1:]  # just the newest token; the rest is in the cache
        logits, ms = timed_ms(self._forward, ids)
        token = sample_next_tokens(logits, [req], self.eos_ids)[0]
        out = StepOutput(batch_size=1)
        if prefill:
            out.prefill_ms, out.num_prefill_tokens = ms, len(ids)
        else:
            out.decode_ms, out.num_decode_tokens = ms, len(ids)
        if req.append_token(token, self.eos_ids, self.max_model_len):
            out.finished.append(req)
            self.current = self.cache = None
        return out

    def _forward(self, ids: list[int]) -> torch.Tensor:
        model = self.model.hf_model
        input_ids = torch.tensor([ids], device=self.model.device)
        # logits_to_keep=1: only the last position's logits are needed (as HF generate does)
        res = model(input_ids=input_ids, past_key_values=self.cache if self.use_cache else None,
                    use_cache=self.use_cache, logits_to_keep=1)
        return res.logits[:, -1]

    # --- memory: one row holding the current request's tokens ----------------------------------
    def _rows(self):
        req = self.current
        if req is None:
            return [], 0
        # KV holds every token except the newest sampled one (it is fed at the next step).
        # Without a cache the keys/values exist only during the forward pass and are then dropped.
        n = req.num_tokens - 1 if self.use_cache else 0
        return [(req.request_id, 0, n, 0)], n
