"""What a user asks for (``SamplingParams``, defined in ``sampling_params.py`` and re-exported here),
what an engine tracks (``Request``) and what comes back (``RequestOutput``). Shared by every step, so
every engine speaks the same language as vLLM.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, fields
from enum import Enum

from .checks import check_field, check_float
from .sampling_params import SamplingParams   # defined there, re-exported here (the API)
from .structured import NO_TOKEN, GrammarState

TokenLogprobs = dict[int, float]     # token id -> log-probability (the chosen token always in it)


class FinishReason(str, Enum):
    STOP = "stop"        # an EOS or stop token was produced
    LENGTH = "length"    # max_tokens reached (or the model's context is full)
    ABORT = "abort"      # cancelled by the caller
    ERROR = "error"      # rejected: see RequestOutput.error

    def __str__(self) -> str:
        """``print`` and f-strings give ``length``, as the JSON outputs and the server do."""
        return self.value


class RequestError(ValueError):
    """A request that cannot be served: it gets an error output, the others go on. ``field``:
    the ``SamplingParams`` field that makes it unservable, when one does (None: its prompt)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class SpecStats:
    """Speculative decoding's counters (rung 6, notebook 06): per request on ``Request.spec`` and
    ``RequestOutput.spec``, per run in ``RunMetrics.extra["speculative"]``."""

    num_steps: int = 0        # verification steps (one target forward each)
    num_proposed: int = 0     # tokens the proposer guessed
    num_accepted: int = 0     # of those, how many the target kept
    num_emitted: int = 0      # tokens appended: accepted guesses + the target's own next token
    propose_ms: float = 0.0   # time in the proposer (a request is billed each step it shares)
    verify_ms: float = 0.0    # time in the target's verifying forward and the acceptance rule

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Accepted guesses per verification step (the target's own token not counted)."""
        return self.num_accepted / self.num_steps if self.num_steps else float("nan")

    @property
    def tokens_per_step(self) -> float:
        return self.num_emitted / self.num_steps if self.num_steps else float("nan")

    def add(self, other: "SpecStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "acceptance_rate": self.acceptance_rate, "mean_accepted": self.mean_accepted,
                "tokens_per_step": self.tokens_per_step}


_ids = itertools.count()


@dataclass
class SampleOutput:
    """One sample's tokens so far and why it ended (vLLM's ``CompletionOutput``). A request has
    one per parallel sample (``n``); beam search has one until the search ends, then the best
    ``beam_width`` hypotheses."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None   # one per token, when ``params.logprobs`` asks


@dataclass
class Request:
    """One prompt in flight. Generated tokens land only through ``commit`` (every engine calls
    it), which also stamps the first-token time and decides when a sample stops.

    ``priority`` is an integer in -2**31..2**31-1 (``FIELD_RANGES``), checked when the request is
    made and again by the scheduler on admission (a caller may assign it afterwards)."""

    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    arrival_offset_s: float = 0.0        # when the workload says it arrives, after the run starts
    priority: int = 0                    # lower runs first ("priority", "score" policies)
    # rung 12's objectives (policy "slo"; None: the config's default), checked on admission
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    outputs: list[SampleOutput] = field(default_factory=lambda: [SampleOutput(0)])
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrival_time: float | None = None    # perf_counter() stamps
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    added_step: int | None = None        # steps of its run done when the engine took it (traces)
    spec: SpecStats | None = None        # speculative decoding's counters (rung 6)
    lora_request: object | None = None   # the LoRA adapter it runs with (rung 13); None: base
    # ``params.prompt_logprobs``: one per prompt token (the first None), landed by
    # ``commit_prompt_logprobs`` as prefill chunks compute them
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # ``params.structured_outputs``: its matchers (``structured.GrammarState``), given by the
    # engine's ``validate``; advanced by ``commit`` only, on the tokens that land
    grammar: GrammarState | None = None

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"
        if not isinstance(self.request_id, str):
            raise ValueError(f"request_id must be a string, got {self.request_id!r}")
        if not isinstance(self.params, SamplingParams):
            self.params = SamplingParams.coerce(self.params)
        self.priority = check_field("priority", self.priority)
        self.arrival_offset_s = check_float("arrival_offset_s", self.arrival_offset_s)
        if self.arrival_offset_s < 0:
            raise ValueError(f"arrival_offset_s must be >= 0, got {self.arrival_offset_s!r}")
        if self.params.logprobs is not None and self.outputs[0].logprobs is None:
            self.outputs[0].logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]    # the first token has nothing before it

    @property
    def cache_salt(self) -> tuple | None:
        """What this request's K/V depend on besides its tokens (vLLM's block-hash extra keys):
        its LoRA adapter (rung 13), or None. Its prefix-cache blocks are hashed from it, so
        requests with different salts never share a cached block."""
        return None if self.lora_request is None else ("lora", self.lora_request.lora_name)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The first sample's tokens so far (the only one unless n > 1 or beam search)."""
        return self.outputs[0].token_ids

    @property
    def samples(self) -> list[list[int]]:
        """Every sample's tokens, by index (after beam search: best first)."""
        return [o.token_ids for o in self.outputs]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, sample: int | None, tokens: list[int] | tuple[int, ...], eos_ids: set[int],
               max_model_len: int, now: float | None = None,
               logprobs: list[TokenLogprobs] | None = None) -> tuple[int, FinishReason | None]:
        """THE place generated tokens land. Append ``tokens`` to sample ``sample``'s output, one
        by one, until one ends it (EOS, a stop token, max_tokens, the model's context); return
        (how many landed, why the sample stopped or None). The first token of the request stamps
        ``first_token_time``. ``sample=None`` (a beam step: its tokens land when the search
        ends, through ``set_final``) only stamps the time. ``logprobs[i]`` (``params.logprobs``)
        lands with ``tokens[i]``. Each landed token advances the sample's grammar (structured
        output), and a complete grammar ends the sample ("stop"); ``NO_TOKEN`` (its grammar
        allowed none) lands nothing and ends it with an error, which fails the request."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter() if now is None else now
        if sample is None:
            return 0, None
        while len(self.outputs) <= sample:                  # n > 1: samples fork after prefill
            self.outputs.append(SampleOutput(len(self.outputs), logprobs=self._new_logprobs()))
        out = self.outputs[sample]
        for i, token in enumerate(tokens):
            if token == NO_TOKEN and self.grammar is not None:
                out.finish_reason = FinishReason.ERROR
                self.error = self.error or self.grammar.dead_end(len(out.token_ids))
                return i, FinishReason.ERROR
            if out.logprobs is not None and logprobs is not None:
                out.logprobs.append(logprobs[i])      # before the token: readers index by it
            out.token_ids.append(token)
            reason = stop_reason(self.params, token, len(out.token_ids),
                                 self.prompt_len + len(out.token_ids), eos_ids, max_model_len)
            if reason is None and self.grammar is not None and self.grammar.advance(sample, token):
                reason = FinishReason.STOP          # the grammar is complete: nothing may follow
            if reason is not None:
                out.finish_reason = reason
                return i + 1, reason
        return len(tokens), None

    def commit_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """Land ``entries``, the log-probabilities of prompt tokens ``first``, ``first + 1``...
        as a prefill chunk computed them. Chunks arrive in order; positions already known (a
        preempted request computes its prompt again) are skipped."""
        have = self.prompt_logprobs
        if have is None or first > len(have):
            raise RuntimeError(f"{self.request_id}: prompt logprobs for position {first} "
                               f"arrived before those of position {len(have or [])} (a bug)")
        have += entries[len(have) - first:]

    def _new_logprobs(self) -> list[TokenLogprobs] | None:
        return [] if self.params.logprobs is not None else None

    def sample_logprobs(self, sample: int) -> list[TokenLogprobs] | None:
        """Sample ``sample``'s logprobs so far (``params.logprobs``), or None when not asked."""
        if sample < len(self.outputs):
            return self.outputs[sample].logprobs
        return self._new_logprobs()

    def set_final(self, samples: list[tuple]) -> None:
        """The request's final samples, best first (beam search's hypotheses; parallel samples
        by index): (token ids, why it ended[, its logprobs])."""
        self.outputs = [SampleOutput(i, list(s[0]), s[1], s[2] if len(s) > 2 else None)
                        for i, s in enumerate(samples)]

    def append_token(self, token_id: int, eos_ids: set[int], max_model_len: int) -> bool:
        """Rungs 0-2: commit one token of the only sample; return True if the request is now
        finished."""
        now = time.perf_counter()
        _, reason = self.commit(0, [token_id], eos_ids, max_model_len, now)
        if reason is not None:
            self.finish(reason, now)
        return self.finished

    def finish(self, reason: FinishReason, now: float | None = None, error: str | None = None):
        """End the request; one whose sample already failed (``commit``) ends with its error."""
        if error is None and self.error is not None:
            reason, error = FinishReason.ERROR, self.error
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
    spec: SpecStats | None = None      # speculative decoding's counters (rung 6)
    finish_reasons: list[FinishReason] = field(default_factory=list)   # one per sample
    # ``params.logprobs``: per sample, one dict per token (``logprobs`` is the first sample's);
    # ``params.prompt_logprobs``: one per prompt token, the first None (vLLM's shapes)
    sample_logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.sample_logprobs[0] if self.sample_logprobs else None

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
                   [list(s) for s in req.samples], req.spec,
                   [o.finish_reason or req.finish_reason for o in req.outputs],
                   [o.logprobs for o in req.outputs], req.prompt_logprobs)
