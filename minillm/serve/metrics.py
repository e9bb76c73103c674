"""``/metrics``: the server's counters in Prometheus' text format, under vLLM's metric names.

Using vLLM's names (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``, ...)
means a Grafana dashboard or a scrape config written for vLLM reads minillm unchanged. The
engine loop thread records: the counters and histograms here (one lock keeps it and the
``/metrics`` handler apart), and after each step the engine's ``EngineStats``
(``runtime/stats.py``), whose newest the handler takes for the gauges: it never reads the engine.
No ``prometheus_client`` dependency: the text format is a few lines.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# vLLM's buckets for these histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# rung 11: a prompt's KV blocks moved from the prefill worker (seconds; bytes, 4 KiB to 4 GiB)
TRANSFER_S_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0, 10.0)
TRANSFER_BYTES_BUCKETS = tuple(float(4 ** k * 1024) for k in range(1, 12))


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)   # per bucket, plus +Inf last (not cumulative)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            cum += c
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cum}')
        return out + [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {cum}"]


MAX_CLASSES = 16     # priority classes with their own histograms; the others share "other"


class ServerMetrics:
    """Counters and histograms since the server started (the gauges come from the engine loop's
    latest ``EngineStats``: ``scrape``)."""

    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(TPOT_BUCKETS)       # every gap between two tokens of a request
        self.tpot = Histogram(TPOT_BUCKETS)      # per request: (latency - ttft) / (tokens - 1)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: dict[str, int] = {}       # finish reason -> requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0                  # prompt tokens looked up in the prefix cache
        self.rejected = 0                        # 429s: the waiting queue was full
        self.by_class: dict[str, tuple[Histogram, Histogram]] = {}   # priority -> (ttft, tpot)
        self.transfers: tuple[Histogram, Histogram] | None = None    # rung 11: (seconds, bytes)

    def _class_of(self, priority: int) -> tuple[Histogram, Histogram]:
        """The histograms of a priority class: one per value, up to MAX_CLASSES (a client
        choosing priorities at random must not grow /metrics without end); the rest: "other"."""
        key = str(priority) if str(priority) in self.by_class or \
            len(self.by_class) < MAX_CLASSES else "other"
        return self.by_class.setdefault(key, (Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS)))

    def observe_finished(self, reason: str, ttft: float | None, latency: float | None,
                         num_tokens: int, priority: int = 0) -> None:
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            ttft_c, tpot_c = self._class_of(priority)
            if ttft is not None:
                self.ttft.observe(ttft)
                ttft_c.observe(ttft)
            if latency is not None:
                self.e2e.observe(latency)
                if ttft is not None and num_tokens > 1:
                    self.tpot.observe((latency - ttft) / (num_tokens - 1))
                    tpot_c.observe((latency - ttft) / (num_tokens - 1))

    def observe_step(self, gaps: list[float], num_tokens: int) -> None:
        """One engine step: the gaps since each request's previous token, tokens generated."""
        with self.lock:
            for g in gaps:
                self.itl.observe(g)
            self.generation_tokens += num_tokens

    def observe(self, event) -> None:
        """An engine observer (``runtime/observe.py``) of rung 11's ``"transferred"`` phase: one
        event per request whose prompt's KV blocks came from the prefill worker."""
        with self.lock:
            if self.transfers is None:
                self.transfers = (Histogram(TRANSFER_S_BUCKETS), Histogram(TRANSFER_BYTES_BUCKETS))
            self.transfers[0].observe(event.data.seconds)
            self.transfers[1].observe(event.data.nbytes)

    def observe_accepted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.prefix_queries += prompt_tokens

    def render(self, gauges: dict[str, float], counters: dict[str, float]) -> str:
        """The text format: ``gauges``/``counters`` are what the caller read (``scrape``: the
        engine loop's latest record)."""
        lab = self.labels
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        for name, value in gauges.items():
            metric(name, "gauge", GAUGE_HELP[name], [f"{name}{{{lab}}} {value}"])
        with self.lock:
            counters = {**counters, "vllm:prompt_tokens_total": self.prompt_tokens,
                        "vllm:generation_tokens_total": self.generation_tokens,
                        "vllm:prefix_cache_queries_total": self.prefix_queries,
                        "minillm:requests_rejected_total": self.rejected}
            for name, value in counters.items():
                metric(name, "counter", COUNTER_HELP[name], [f"{name}{{{lab}}} {value}"])
            metric("vllm:request_success_total", "counter", "Finished requests by finish reason.",
                   [f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {n}'
                    for r, n in sorted(self.finished.items())])
            for name, hist, help_ in (
                    ("vllm:time_to_first_token_seconds", self.ttft, "Time to first token."),
                    ("vllm:inter_token_latency_seconds", self.itl, "Time between two tokens."),
                    ("vllm:time_per_output_token_seconds", self.tpot,
                     "Per request: mean time per output token after the first."),
                    ("vllm:e2e_request_latency_seconds", self.e2e, "Arrival to finish.")):
                metric(name, "histogram", help_, hist.lines(name, lab))
            for name, i, help_ in (
                    ("minillm:time_to_first_token_by_priority_seconds", 0,
                     "Time to first token, per priority class (the request's priority field)."),
                    ("minillm:time_per_output_token_by_priority_seconds", 1,
                     "Mean time per output token after the first, per priority class.")):
                metric(name, "histogram", help_, [
                    line for c, hists in sorted(self.by_class.items())
                    for line in hists[i].lines(name, f'{lab},priority="{c}"')])
            for name, i, help_ in (
                    ("minillm:kv_transfer_seconds", 0, "Per request (disagg engine): from asking "
                     "the prefill worker for a prompt's KV blocks to their landing in the decode "
                     "pool."),
                    ("minillm:kv_transfer_bytes", 1, "Per request (disagg engine): bytes of KV "
                     "moved from the prefill worker's pool to the decode pool.")):
                if self.transfers is not None:
                    metric(name, "histogram", help_, self.transfers[i].lines(name, lab))
        return "\n".join(lines) + "\n"


GAUGE_HELP = {
    "vllm:num_requests_running": "Requests in the running batch (holding KV memory).",
    "vllm:num_requests_waiting": "Requests accepted and waiting to be scheduled.",
    "vllm:kv_cache_usage_perc": "Fraction of KV-cache slots in use (1 = full).",
    "minillm:kv_cache_bytes_per_token": "Bytes one token's K and V take in the pool, over all "
                                        "layers, in its kv_cache_dtype (scales included).",
    "minillm:kv_cache_bytes": "Bytes of the KV pool (free and cached slots included).",
    "minillm:kv_cache_used_bytes": "Bytes of the KV pool held by requests.",
    "minillm:batch_cap": "Rung 12's batch controller: the step's token budget now.",
    "minillm:batch_load": "Rung 12's batch controller: the arrivals' work over what the TPOT "
                          "target's batch serves (above 1: they outrun it).",
}
COUNTER_HELP = {
    "vllm:num_preemptions_total": "Preemptions (a running request's KV dropped to recompute).",
    "vllm:prefix_cache_hits_total": "Prompt tokens served from the prefix cache.",
    "vllm:prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "vllm:prompt_tokens_total": "Prompt tokens of accepted requests.",
    "vllm:generation_tokens_total": "Tokens generated.",
    "minillm:engine_steps_total": "Engine steps run by the server.",
    "minillm:engine_step_seconds_total": "Seconds spent inside engine.step().",
    "minillm:loop_overhead_seconds_total": "Seconds the engine loop spent after steps handing "
                                           "tokens to clients (serving's own overhead).",
    "minillm:requests_rejected_total": "Requests refused with 429 because the queue was full.",
}


def scrape(loop) -> tuple[dict[str, float], dict[str, float]]:
    """What ``/metrics`` shows, (gauges, counters): the engine loop's latest ``EngineStats`` (the
    record its thread built after the latest step) and the loop's own counters, never the engine
    itself (the loop's thread owns it: stats flow one way)."""
    stats, waiting = loop.latest()
    kv = stats.kv
    gauges = {"vllm:num_requests_running": stats.num_running,
              "vllm:num_requests_waiting": waiting,
              "vllm:kv_cache_usage_perc": (kv.allocated / kv.total) if kv.total else 0.0,
              # real bytes, in the pool's own format (a narrow kv_cache_dtype: rung 9)
              "minillm:kv_cache_bytes_per_token": kv.bytes_per_slot,
              "minillm:kv_cache_bytes": kv.total * kv.bytes_per_slot,
              "minillm:kv_cache_used_bytes": kv.allocated * kv.bytes_per_slot}
    if stats.batch_cap is not None:                # rung 12: the adaptive batch
        gauges["minillm:batch_cap"] = stats.batch_cap
    if stats.batch_load is not None:
        gauges["minillm:batch_load"] = stats.batch_load
    counters = {"vllm:num_preemptions_total": stats.num_preemptions,
                "vllm:prefix_cache_hits_total": stats.prefix_hit_tokens,
                "minillm:engine_steps_total": stats.step,
                "minillm:engine_step_seconds_total": loop.engine_step_s,
                "minillm:loop_overhead_seconds_total": loop.overhead_s}
    return gauges, counters
