"""Mixed workloads: classes of requests on one Poisson clock, reported per class.

``--mix policies`` (``--mix`` alone; notebook 08: ``python -m minillm bench --serve
minillm:fcfs,minillm:priority,minillm:score --mix``), as on a server that takes both chat traffic
and offline jobs: ``interactive`` (short prompts, short answers, priority 0, a tight TTFT
objective) and ``batch`` (long prompts, long answers, priority 1, a loose one).

``--mix disagg`` (notebook 11: ``--serve minillm,minillm:disagg --mix disagg``): ``steady``
requests (short prompts, long answers: decodes that run all along) among which ``long`` ones
arrive (long prompts, a few tokens): in one engine each long prefill stalls the steady decodes
(their ITL and TPOT spike); disaggregated, it runs on the prefill worker.

``--mix deadlines`` (rung 12: ``--serve minillm:fcfs,minillm:score,minillm:slo --mix
deadlines``): one priority for all, so only the objectives tell the classes apart: ``urgent``
requests (long answers, first token within 3 s) and ``background`` ones (short answers, within
30 s). Shortest-remaining-first (``score``) serves the short background jobs first; the deadline
order (``slo``) does not.

Every server gets the same bodies at the same times; the report splits TTFT, TPOT and ITL by
class and counts **goodput**: the requests per second that finished within their class's
objectives (DistServe's measure), beside the plain throughput. Prompts are random token ids
(``client.random_ids``), so their lengths are exact; ``ignore_eos`` fixes the answers' lengths.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from .client import RequestResult, random_ids


@dataclass(frozen=True)
class RequestClass:
    name: str
    priority: int
    input_len: int
    max_tokens: int
    slo_ttft_ms: float          # the class's objective: first token within this
    share: float = 0.5          # the chance that a request is of this class
    slo_tpot_ms: float = math.inf   # and (where set) a mean time per output token within this


MIXES: dict[str, tuple[RequestClass, ...]] = {
    "policies": (RequestClass("interactive", 0, 64, 32, 1000.0),
                 RequestClass("batch", 1, 512, 128, 20000.0)),
    "disagg": (RequestClass("steady", 0, 32, 128, 2000.0, 0.75, slo_tpot_ms=150.0),
               RequestClass("long", 0, 1024, 8, 20000.0, 0.25)),
    "deadlines": (RequestClass("urgent", 0, 128, 128, 3000.0),
                  RequestClass("background", 0, 64, 16, 30000.0)),
}


def slo_fields(c: RequestClass) -> dict:
    """The class's objectives, sent with each request (``ttft_slo_ms``, ``tpot_slo_ms``): what
    ``policy="slo"`` schedules by (rung 12); the other policies ignore them."""
    return {"ttft_slo_ms": c.slo_ttft_ms,
            **({} if math.isinf(c.slo_tpot_ms) else {"tpot_slo_ms": c.slo_tpot_ms})}


def make_mixed_bodies(model: str, num_requests: int, seed: int,
                      mix: str = "policies") -> tuple[list[dict], list[RequestClass]]:
    """Bodies for /v1/completions and each one's class (of ``MIXES[mix]``), drawn with ``seed``
    by the classes' shares."""
    rng = random.Random(seed)
    kinds, ids = MIXES[mix], random_ids(model)
    bodies, classes = [], []
    for _ in range(num_requests):
        c = rng.choices(kinds, weights=[k.share for k in kinds])[0]
        prompt = [rng.choice(ids) for _ in range(c.input_len)]
        bodies.append({"model": model, "prompt": prompt,
                       "max_tokens": c.max_tokens, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True,
                       "priority": c.priority, **slo_fields(c)})
        classes.append(c)
    return bodies, classes


def by_class(results: list[RequestResult], classes: list[RequestClass], duration: float,
             mix: str = "policies") -> dict:
    """Per class of ``MIXES[mix]``: completed, TTFT, TPOT and ITL P50/P99 (ms), goodput
    (requests/s within the class's objectives); and ``all``: throughput and total goodput."""
    out = {}
    for c in MIXES[mix]:
        mine = [r for r, k in zip(results, classes) if k is c and r.ok]
        ttft = np.array([r.ttft for r in mine] or [np.nan]) * 1e3
        tpot = np.array([r.tpot for r in mine if r.output_tokens > 1] or [np.nan]) * 1e3
        itl = np.array([g for r in mine for g in r.itl] or [np.nan]) * 1e3
        good = sum(1 for r in mine if r.ttft * 1e3 <= c.slo_ttft_ms and
                   not r.tpot * 1e3 > c.slo_tpot_ms)
        out[c.name] = {"requests": sum(1 for k in classes if k is c), "completed": len(mine),
                       "slo_ttft_ms": c.slo_ttft_ms,
                       "slo_tpot_ms": None if math.isinf(c.slo_tpot_ms) else c.slo_tpot_ms,
                       "met_slo": good,
                       "goodput_req_s": good / duration if duration else 0.0,
                       "ttft_p50_ms": float(np.percentile(ttft, 50)),
                       "ttft_p99_ms": float(np.percentile(ttft, 99)),
                       "tpot_p50_ms": float(np.percentile(tpot, 50)),
                       "tpot_p99_ms": float(np.percentile(tpot, 99)),
                       "itl_p50_ms": float(np.percentile(itl, 50)),
                       "itl_p99_ms": float(np.percentile(itl, 99))}
    ok = [r for r in results if r.ok]
    out["all"] = {"output_tok_s": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
                  "goodput_req_s": sum(out[c.name]["goodput_req_s"] for c in MIXES[mix])}
    return out


def objectives(c: RequestClass) -> str:
    tpot = "" if math.isinf(c.slo_tpot_ms) else f", TPOT ≤ {c.slo_tpot_ms:g} ms"
    return f"p{c.priority}, TTFT ≤ {c.slo_ttft_ms / 1e3:g} s{tpot}"


def ms(k: dict, key: str) -> str:
    """A time in whole ms, or "—" where a report does not have it (one saved before it did)."""
    return f"{k[key]:.0f}" if key in k else "—"


def class_table(per_server: dict[str, dict], mix: str = "policies") -> str:
    """One markdown row per (server, class): the tables of docs/rungs/08_policies.md and
    11_disagg.md."""
    lines = ["| server | class | completed | TTFT P50 / P99 (ms) | TPOT P50 / P99 (ms) | "
             "ITL P50 / P99 (ms) | within objectives | goodput (req/s) | output tok/s |",
             "|" + "---|" * 9]
    for name, m in per_server.items():
        for c in MIXES[mix]:
            k = m[c.name]
            lines.append(f"| {name} | {c.name} ({objectives(c)}) | "
                         f"{k['completed']}/{k['requests']} | {k['ttft_p50_ms']:.0f} / "
                         f"{k['ttft_p99_ms']:.0f} | {k['tpot_p50_ms']:.0f} / "
                         f"{k['tpot_p99_ms']:.0f} | {ms(k, 'itl_p50_ms')} / "
                         f"{ms(k, 'itl_p99_ms')} | {k['met_slo']} | {k['goodput_req_s']:.2f} | "
                         f"{m['all']['output_tok_s']:.1f} |")
    return "\n".join(lines)
