"""Timestamps in, serving metrics out: TTFT, TPOT, latency percentiles, throughput, KV waste.

Every engine records one ``StepRecord`` per engine step and returns ``RequestOutput``s with their
timings; ``summarize`` turns both into the numbers in the benchmark table.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .memory import KVCounts, waste_fraction
from .request import FinishReason, RequestOutput


@dataclass
class StepRecord:
    """One engine step: what it computed, how long it took, and the KV memory after it. The
    visualizer's replays record the same type (``Engine.record``), so a replay and a real run are
    compared field by field."""

    step: int
    time_s: float = 0.0           # since the run started
    prefill_ms: float = 0.0       # forward time spent on prompt tokens
    decode_ms: float = 0.0        # forward time spent on one-token-per-sequence decoding
    batch_size: int = 0           # sequences in this step's forward
    num_prefill_tokens: int = 0   # prompt tokens computed this step (prefix-cache hits excluded)
    num_decode_tokens: int = 0
    kv: KVCounts = field(default_factory=KVCounts)   # KV slots by kind after the step
    num_running: int = 0          # requests holding KV memory after the step
    num_waiting: int = 0          # requests waiting for memory after the step
    num_finished: int = 0         # requests finished so far in this run
    num_preemptions: int = 0      # so far in this run
    prefix_hit_tokens: int = 0    # prompt tokens served from the prefix cache so far

@dataclass
class RunMetrics:
    engine: str
    num_requests: int
    num_errors: int
    duration_s: float
    output_tokens: int
    prompt_tokens: int
    prefill_tokens_computed: int
    output_tok_s: float
    requests_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p95_s: float
    latency_p50_s: float
    latency_p95_s: float
    latency_p99_s: float
    peak_kv_allocated_bytes: int
    peak_kv_token_bytes: int
    kv_waste_pct: float           # time-averaged: 1 - sum(token slots) / sum(allocated slots)
    peak_concurrency: int
    num_steps: int
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(engine: str, outputs: list[RequestOutput], steps: list[StepRecord],
              duration_s: float, bytes_per_slot: int) -> RunMetrics:
    ok = [o for o in outputs if o.finish_reason != FinishReason.ERROR]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
    lat = [o.latency_s for o in ok if o.latency_s is not None]
    out_tokens = sum(sum(len(s) for s in o.samples) or len(o.token_ids) for o in ok)
    alloc = sum(s.kv.allocated for s in steps)
    used = sum(s.kv.token for s in steps)
    return RunMetrics(
        engine=engine, num_requests=len(outputs), num_errors=len(outputs) - len(ok),
        duration_s=duration_s, output_tokens=out_tokens,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in ok),
        prefill_tokens_computed=sum(s.num_prefill_tokens for s in steps),
        output_tok_s=out_tokens / duration_s if duration_s > 0 else 0.0,
        requests_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p95_s=percentile(tpot, 95),
        latency_p50_s=percentile(lat, 50), latency_p95_s=percentile(lat, 95),
        latency_p99_s=percentile(lat, 99),
        peak_kv_allocated_bytes=max((s.kv.allocated for s in steps), default=0) * bytes_per_slot,
        peak_kv_token_bytes=max((s.kv.token for s in steps), default=0) * bytes_per_slot,
        kv_waste_pct=100.0 * waste_fraction(used, alloc),
        peak_concurrency=max((s.num_running for s in steps), default=0),
        num_steps=len(steps), num_preemptions=sum(o.num_preemptions for o in outputs),
    )
