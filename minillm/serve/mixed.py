"""A mixed workload for scheduling policies (notebook 08): ``python -m minillm bench --serve
minillm:fcfs,minillm:priority,minillm:score --mix``.

Two classes of requests share one Poisson clock, as on a server that takes both chat traffic and
offline jobs: ``interactive`` (short prompts, short answers, priority 0, a tight TTFT objective)
and ``batch`` (long prompts, long answers, priority 1, a loose one). Every server gets the same
bodies at the same times; the report splits TTFT and TPOT by class and counts **goodput**: the
requests per second that finished within their class's TTFT objective (DistServe's measure),
beside the plain throughput. Prompts are random token ids (``loadgen.RANDOM_IDS``), so their
lengths are exact; ``ignore_eos`` fixes the answers' lengths.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from .loadgen import RANDOM_IDS, RequestResult


@dataclass(frozen=True)
class RequestClass:
    name: str
    priority: int
    input_len: int
    max_tokens: int
    slo_ttft_ms: float          # the class's objective: first token within this


CLASSES = (RequestClass("interactive", 0, 64, 32, 1000.0),
           RequestClass("batch", 1, 512, 128, 20000.0))


def make_mixed_bodies(model: str, num_requests: int, seed: int,
                      interactive_share: float = 0.5) -> tuple[list[dict], list[RequestClass]]:
    """Bodies for /v1/completions and each one's class, drawn with ``seed``: a request is
    interactive with probability ``interactive_share``."""
    rng = random.Random(seed)
    bodies, classes = [], []
    for _ in range(num_requests):
        c = CLASSES[0] if rng.random() < interactive_share else CLASSES[1]
        prompt = [rng.choice(RANDOM_IDS) for _ in range(c.input_len)]
        bodies.append({"model": model, "prompt": prompt,
                       "max_tokens": c.max_tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True,
                       "priority": c.priority})
        classes.append(c)
    return bodies, classes


def by_class(results: list[RequestResult], classes: list[RequestClass], duration: float) -> dict:
    """Per class: completed, TTFT and TPOT P50/P99 (ms), goodput (requests/s within the class's
    TTFT objective); and ``all``: throughput and total goodput."""
    out = {}
    for c in CLASSES:
        mine = [r for r, k in zip(results, classes) if k is c and r.ok]
        ttft = np.array([r.ttft for r in mine] or [np.nan]) * 1e3
        tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in mine
                         if r.output_tokens > 1] or [np.nan]) * 1e3
        good = sum(1 for r in mine if r.ttft * 1e3 <= c.slo_ttft_ms)
        out[c.name] = {"requests": sum(1 for k in classes if k is c), "completed": len(mine),
                       "slo_ttft_ms": c.slo_ttft_ms, "met_slo": good,
                       "goodput_req_s": good / duration if duration else 0.0,
                       "ttft_p50_ms": float(np.percentile(ttft, 50)),
                       "ttft_p99_ms": float(np.percentile(ttft, 99)),
                       "tpot_p50_ms": float(np.percentile(tpot, 50)),
                       "tpot_p99_ms": float(np.percentile(tpot, 99))}
    ok = [r for r in results if r.ok]
    out["all"] = {"output_tok_s": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
                  "goodput_req_s": sum(out[c.name]["goodput_req_s"] for c in CLASSES)}
    return out


def class_table(per_server: dict[str, dict]) -> str:
    """One markdown row per (server, class): what the README's policy table shows."""
    lines = ["| server | class | completed | TTFT P50 / P99 (ms) | TPOT P50 / P99 (ms) | "
             "within TTFT objective | goodput (req/s) | output tok/s |", "|" + "---|" * 8]
    for name, m in per_server.items():
        for c in CLASSES:
            k = m[c.name]
            lines.append(f"| {name} | {c.name} (p{c.priority}, ≤ {c.slo_ttft_ms / 1e3:g} s) | "
                         f"{k['completed']}/{k['requests']} | {k['ttft_p50_ms']:.0f} / "
                         f"{k['ttft_p99_ms']:.0f} | {k['tpot_p50_ms']:.0f} / "
                         f"{k['tpot_p99_ms']:.0f} "
                         f"| {k['met_slo']} | {k['goodput_req_s']:.2f} | "
                         f"{m['all']['output_tok_s']:.1f} |")
    return "\n".join(lines)
