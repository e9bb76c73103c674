"""The client side of a served benchmark (notebook 08; ``python -m minillm bench --serve``):
request bodies, sending them at their arrival times with at most ``concurrency`` in flight, each
streamed, and the summary in ``vllm bench serve``'s names and layout (TTFT, ITL, TPOT; see
``loadgen.py``). It speaks plain OpenAI HTTP and loads no model."""
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


RANDOM_IDS = range(1000, 30000)     # SmolLM2's ordinary tokens (of 49,152)


def random_ids(model: str) -> range:
    """The token ids random prompts are drawn from, inside ``model``'s vocabulary: ``RANDOM_IDS``,
    or, for the tiny random model (a vocabulary of 512, which a server refuses ids past), all of
    its ids but the first few."""
    if model == "tiny-llama":
        from ..models import tiny_llama_config     # imports torch: for the tiny model only
        return range(4, tiny_llama_config().vocab_size)
    return RANDOM_IDS


def make_bodies(model: str, num_requests: int, max_tokens: int, seed: int, chat: bool,
                ignore_eos: bool, input_len: int | None = None) -> list[dict]:
    """Request bodies: chat prompts from the bundled set, or (``input_len``) random token-id
    prompts of exactly that many tokens on /v1/completions."""
    rng = random.Random(seed)
    prompts = [p for p in load_prompts() if p.get("category") in CHAT_MIX]
    ids = random_ids(model) if input_len else RANDOM_IDS
    bodies = []
    for _ in range(num_requests):
        messages = rng.choice(prompts)["messages"]
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if input_len:
            body["prompt"] = [rng.choice(ids) for _ in range(input_len)]
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
              seed: int, chat: bool, timeout_s: float = 600.0,
              burst: tuple[int, float] | None = None) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    offsets = arrival_offsets(len(bodies), random.Random(seed), None if math.isinf(rate) else rate,
                              burst)
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
