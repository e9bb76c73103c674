"""Rung 1 — static batching: take N requests, pad them into one batch, run it to the very end.

One forward now serves N sequences, so the weights are read once per N tokens instead of once per
token: the big win over rung 0. The cost (notebook 01_static_batching):

* the batch lasts as long as its *longest* request; a request that finished after 2 tokens keeps
  its row, and the engine keeps computing garbage for it, until the last one is done;
* nobody can join mid-batch, so newcomers wait for the whole batch (TTFT suffers);
* a static server must reserve ``rows x (longest prompt + max_tokens)`` KV slots up front, because
  it cannot know when each request will stop. That reservation is what the memory view shows:
  left padding, the tokens, then reserved slots that may never be written.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from transformers import StaticCache

from ..runtime.config import option, set_checked
from ..request import FinishReason, Request
from ..sampling import sample_next_tokens
from ..runtime.interface import StepOutput, timed_ms
from .base import ContiguousEngine
from .padded import hf_forward, left_pad


@dataclass(frozen=True)
class StaticConfig:
    batch_size: int = option(32, "static: requests per batch")

    def __post_init__(self):
        set_checked(self, "batch_size")


class StaticBatchEngine(ContiguousEngine):
    name = "static"
    configs = (StaticConfig,)

    def __init__(self, model, **options):
        """``options``: ``StaticConfig``'s (``batch_size=32``)."""
        super().__init__(model, **options)
        self.batch_size = self.static_config.batch_size
        self.waiting: deque[Request] = deque()
        self.batch: list[Request] = []
        self.cache: StaticCache | None = None
        self.mask: torch.Tensor | None = None

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.batch) or bool(self.waiting)

    def num_running(self) -> int:
        return len(self.batch)

    def reset(self) -> list[Request]:
        dropped = [r for r in self.batch if not r.finished] + list(self.waiting)
        for r in dropped:
            r.finish(FinishReason.ABORT)
        self.waiting.clear()
        self.batch, self.cache, self.mask = [], None, None
        return dropped

    @torch.inference_mode()
    def _step(self) -> StepOutput:
        if not self.batch:
            return self._prefill()
        return self._decode()

    def _prefill(self) -> StepOutput:
        n = min(self.batch_size, len(self.waiting))
        self.batch = [self.waiting.popleft() for _ in range(n)]
        ids, self.mask = left_pad([r.prompt_token_ids for r in self.batch], self.model.pad_token_id,
                                  self.model.device)
        # The reservation, made real: one preallocated rectangle written in place at every step.
        # (HF's DynamicCache would instead copy the whole cache at every step to grow it.)
        self.cache = StaticCache(config=self.model.config, max_cache_len=self._width())
        logits, ms = timed_ms(hf_forward, self.model.hf_model, ids, self.mask, self.cache)
        out = StepOutput(prefill_ms=ms, batch_size=n, num_prefill_tokens=int(self.mask.sum()))
        self._append(logits, out)
        return out

    def _decode(self) -> StepOutput:
        # Finished rows are still fed (a pad token) and still computed: that is static batching.
        last = [r.output_token_ids[-1] if not r.finished else self.model.pad_token_id
                for r in self.batch]
        ids = torch.tensor(last, device=self.model.device)[:, None]
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        logits, ms = timed_ms(hf_forward, self.model.hf_model, ids, self.mask, self.cache)
        out = StepOutput(decode_ms=ms, batch_size=len(self.batch),
                         num_decode_tokens=sum(not r.finished for r in self.batch))
        self._append(logits, out)
        return out

    def _append(self, logits: torch.Tensor, out: StepOutput) -> None:
        live = [i for i, r in enumerate(self.batch) if not r.finished]
        tokens = sample_next_tokens(logits[live], [self.batch[i] for i in live], self.eos_ids)
        for i, tok in zip(live, tokens):
            if self.batch[i].append_token(tok, self.eos_ids, self.max_model_len):
                out.finished.append(self.batch[i])
        if all(r.finished for r in self.batch):
            self.batch, self.cache, self.mask = [], None, None

    # --- memory: the reservation rows x (longest prompt + largest max_tokens) -------------------
    def _width(self) -> int:
        """Columns the batch can reach: its longest prompt plus the most tokens any row may still
        produce. Each row stops at its own context limit, but a short row sits behind left padding,
        so the rectangle may be wider than the model's context."""
        longest = max(r.prompt_len for r in self.batch)
        return longest + max(min(r.params.max_tokens, self.max_model_len - r.prompt_len)
                             for r in self.batch)

    def _rows(self):
        if not self.batch:
            return [], 0
        longest = max(r.prompt_len for r in self.batch)
        width = self._width()
        rows = []
        for r in self.batch:
            pad = longest - r.prompt_len
            ntok = r.num_tokens - 1  # the newest token is not in the KV yet (fed next step)
            rows.append((r.request_id, pad, ntok, width - pad - ntok))
        return rows, width
