"""What a user asks for (``SamplingParams``), what an engine tracks (``Request``) and what comes back
(``RequestOutput``). Shared by every step, so every engine speaks the same language as vLLM.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"        # an EOS or stop token was produced
    LENGTH = "length"    # max_tokens reached (or the model's context is full)
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # rejected: see RequestOutput.error


class RequestError(ValueError):
    """A request that cannot be served: it gets an error output, the others go on."""


@dataclass
class SamplingParams:
    """How to pick tokens. Temperature 0 means greedy (argmax), as in vLLM.

    ``seed`` makes sampling reproducible per request: the random draw for output token ``i`` depends
    only on (seed, i), never on which other requests happened to share the batch.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0           # 0 = no top-k limit (vLLM uses -1; we document 0)
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1               # parallel samples sharing one prompt (step 3)
    beam_width: int = 1      # beam search (step 3); 1 = off

    def __post_init__(self):
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}"),
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (isinstance(self.beam_width, int) and self.beam_width >= 1,
             f"beam_width must be an integer >= 1, got {self.beam_width!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_ids = itertools.count()


@dataclass
class Request:
    """One prompt in flight. Engines append to ``output_token_ids`` and stamp the timestamps."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    arrival_offset_s: float = 0.0        # when the workload says it arrives, after the run starts
    priority: int = 0                    # lower runs first under the "priority" policy
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time: float | None = None    # perf_counter() stamps
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append_token(self, token_id: int, eos_ids: set[int], max_model_len: int) -> bool:
        """Record a generated token; return True if the request is now finished."""
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(token_id)
        reason = stop_reason(self.params, token_id, len(self.output_token_ids), self.num_tokens,
                             eos_ids, max_model_len)
        if reason is not None:
            self.finish(reason, now)
        return self.finished

    def finish(self, reason: FinishReason, now: float | None = None, error: str | None = None):
        self.finish_reason = reason
        self.error = error
        self.finish_time = now if now is not None else time.perf_counter()


def stop_reason(params: SamplingParams, token_id: int, num_output_tokens: int, num_tokens: int,
                eos_ids: set[int], max_model_len: int) -> FinishReason | None:
    """Why a sequence that just produced ``token_id`` must stop, or None to go on."""
    if (not params.ignore_eos and token_id in eos_ids) or token_id in params.stop_token_ids:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


@dataclass
class RequestOutput:
    """The result of one request, with the timings every benchmark is built from."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    error: str | None = None
    ttft_s: float | None = None        # arrival -> first token
    latency_s: float | None = None     # arrival -> finish
    num_preemptions: int = 0
    # n > 1 / beam search: every sequence of the request, best first (``token_ids`` is the first)
    samples: list[list[int]] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (decode speed as a user feels it)."""
        if self.ttft_s is None or self.latency_s is None or len(self.token_ids) < 2:
            return None
        return (self.latency_s - self.ttft_s) / (len(self.token_ids) - 1)

    @classmethod
    def from_request(cls, req: Request, text: str = "") -> "RequestOutput":
        ttft = lat = None
        if req.arrival_time is not None:
            if req.first_token_time is not None:
                ttft = req.first_token_time - req.arrival_time
            if req.finish_time is not None:
                lat = req.finish_time - req.arrival_time
        return cls(req.request_id, req.prompt_token_ids, list(req.output_token_ids), text,
                   req.finish_reason, req.error, ttft, lat, req.num_preemptions,
                   [list(req.output_token_ids)])
