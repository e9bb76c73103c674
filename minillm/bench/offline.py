"""The side-by-side benchmark: every engine on the same workload, in one process, one table.

    python -m minillm bench --quick      # what `make bench` runs (--dtype auto, as generate/serve)

Besides the main table it runs the experiments (``--experiments``): prefix caching with a shared
system prompt, n = 4 parallel sampling vs four independent requests, how many requests fit one KV
budget paged vs. reserving a maximum length per request, speculative decoding (rung 6) and one KV
budget under each ``kv_cache_dtype`` (rung 9, bench_kv.py). Results: JSON and ``figures/``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .kv import exp_kv_dtype
from .run import PEERS, run_engine, warmup_items
from .vllm_peer import PeerError
from .table import (WARMS_UP_ITSELF, engine_of, finish_table, measure_matmul_gflops,
                    model_gflop_per_token, single_stream, table_row, table_runs,
                    workload_of)
from ..engines import ENGINES, options_for, options_from

FIGURES = Path(__file__).resolve().parents[2] / "figures"
ALL_ENGINES = ENGINES + tuple(PEERS)
DEFAULT_ENGINES = ("naive", "static", "dynamic", "paged", "hf-static", "hf-generate-batch")
EXPERIMENTS = ("prefix", "parallel", "capacity", "speculative", "kv_dtype")
SPEC_ENGINES = ("paged", "paged+ngram", "paged+draft")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated, from: {', '.join(ALL_ENGINES)}")
    p.add_argument("--requests", type=int, default=None, help="workload size (default 256, quick 128)")
    p.add_argument("--naive-requests", type=int, default=None,
                   help="naive engines serve one request at a time: run them on the first N "
                        "requests only (default 8, quick 6)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at t=0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-prompts", action="store_true",
                   help="include the long-document prompts (350-860 tokens) in the workload")
    p.add_argument("--max-batch", type=int, default=64,
                   help="the same concurrency cap for every batching engine: static and hf-static "
                        "batch size, dynamic and paged max_num_seqs (default 64)")
    p.add_argument("--quick", action="store_true", help="smaller workload (~10 min on a 2-core CPU)")
    p.add_argument("--experiments", default=",".join(EXPERIMENTS),
                   help=f"step-3 experiments to run after the table ({', '.join(EXPERIMENTS)}, or none)")
    p.add_argument("--json", default=None, help="write results here (default figures/bench.json)")
    p.add_argument("--no-figure", action="store_true")


# --- the main table ---------------------------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    head = ["engine", "tok/s", "vs naive", "1-stream tok/s", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95",
            "lat p50", "lat p95", "peak KV", "waste %", "peak conc", "roofline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def t(v: float, fmt: str, scale: float = 1.0) -> str:     # n/a where a peer reports none
        return "n/a" if v != v else fmt.format(v * scale)
    for r in rows:
        kv = f"{r['peak_kv_allocated_bytes'] / 2**20:.0f} MiB" if r["peak_kv_allocated_bytes"] else "n/a"
        waste = f"{r['kv_waste_pct']:.1f}" if r["peak_kv_allocated_bytes"] else "n/a"
        lines.append("| " + " | ".join([
            r["engine"], f"{r['output_tok_s']:.1f}", t(r.get("speedup_vs_naive", float("nan")), "{:.1f}x"),
            t(r.get("single_stream_tok_s") or float("nan"), "{:.1f}"),
            t(r["ttft_p50_s"], "{:.2f}s"), t(r["ttft_p95_s"], "{:.2f}s"),
            t(r["tpot_p50_s"], "{:.0f}ms", 1000), t(r["tpot_p95_s"], "{:.0f}ms", 1000),
            t(r["latency_p50_s"], "{:.1f}s"), t(r["latency_p95_s"], "{:.1f}s"),
            kv, waste, str(r["peak_concurrency"] or "n/a"), f"{100 * r['roofline']:.0f}%"]) + " |")
    return "\n".join(lines)


def run_table(model, engines: list[str], items, naive_items, options: dict) -> list[dict]:
    peak = measure_matmul_gflops()
    per_tok = model_gflop_per_token(model)
    print(f"fp32 matmul peak: {peak:.0f} GFLOP/s; model: {per_tok:.3f} GFLOP/token")
    rows, outputs = [], {}
    for label, opts in table_runs(model, engines, items, options):
        name = engine_of(label)
        work = workload_of(name, items, naive_items)
        if name not in WARMS_UP_ITSELF:
            run_engine(model, name, warmup_items(items), opts, progress=False)
        t = time.perf_counter()
        res = run_engine(model, name, work, opts)
        if label == "paged":      # the other engines' rows are throughput rows; vLLM has its own
            res.metrics.extra |= single_stream(model, name, items, opts)
        rows.append(table_row(label, res, per_tok, peak))
        print(f"  {label:18s} {rows[-1]['output_tok_s']:7.1f} tok/s  ({time.perf_counter() - t:.0f}s, "
              f"{len(work)} requests)", flush=True)
        outputs[label] = [o.token_ids for o in res.outputs]
    return finish_table(rows, outputs)


# --- step-3 experiments --------------------------------------------------------------------------
def exp_prefix(model, n: int, seed: int, options: dict) -> dict:
    """Same shared 256-token system prompt on every request, prefix caching off vs on.

    One earlier request has already been served (as on any live server), so the system prompt's
    blocks are in the cache when the measured requests arrive."""
    from ..llm import LLM
    from ..workload import make_workload, to_requests

    items = make_workload(n, seed, shared_prefix=True, short=(8, 32), long=(32, 64), p_long=0.2)
    out = {}
    for on in (False, True):
        opts = options_for("paged", options)
        llm = LLM(model, engine="paged", **{**opts, "enable_prefix_caching": on, "max_num_seqs": 8})
        llm.run(to_requests(llm, warmup_items(make_workload(1, seed + 1, shared_prefix=True))))
        m = llm.run(to_requests(llm, items), progress=True).metrics
        out["on" if on else "off"] = {"prefill_tokens_computed": m.prefill_tokens_computed,
                                      "prompt_tokens": m.prompt_tokens, "ttft_p50_s": m.ttft_p50_s,
                                      "output_tok_s": m.output_tok_s}
    off, on = out["off"], out["on"]
    out["prefill_reduction_pct"] = 100 * (1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"])
    out["ttft_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"]
    return out


def exp_parallel(model, n: int, seed: int, options: dict) -> dict:
    """n = 4 samples of one prompt share its blocks; four independent requests do not."""
    from dataclasses import replace
    from ..workload import make_workload

    shared = make_workload(n, seed, n=4, short=(32, 64), long=(64, 96), p_long=0.3)
    independent = [replace(it, params=replace(it.params, n=1, seed=seed + k))
                   for it in shared for k in range(4)]
    out = {}
    for label, items in (("n4", shared), ("independent", independent)):
        res = run_engine(model, "paged", items, {**options, "max_num_seqs": 4 * n})
        out[label] = {"peak_blocks": max(s.kv.allocated for s in res.steps) // options.get("block_size", 16),
                      "output_tokens": res.metrics.output_tokens}
    out["block_saving_pct"] = 100 * (1 - out["n4"]["peak_blocks"] / out["independent"]["peak_blocks"])
    return out


def exp_capacity(model, n: int, seed: int, options: dict, reserve_tokens: int = 2048,
                 budget_requests: int = 2) -> dict:
    """At one KV budget (``budget_requests`` max-length reservations), how many requests run at
    once when memory is paged?"""
    from ..workload import make_workload
    budget = budget_requests * reserve_tokens * model.kv_bytes_per_token
    items = make_workload(n, seed)
    res = run_engine(model, "paged", items, {**options, "kv_cache_bytes": budget, "max_num_seqs": n})
    return {"kv_budget_bytes": budget, "reserve_tokens": reserve_tokens,
            "reservation_concurrency": budget_requests,
            "paged_peak_concurrency": res.metrics.peak_concurrency,
            "ratio": res.metrics.peak_concurrency / budget_requests,
            "preemptions": res.metrics.num_preemptions}


def exp_speculative(model, n: int, seed: int, options: dict,
                    lengths: tuple[int, int] = (64, 128), warmup: bool = True) -> dict:
    """Rung 6: plain paged vs paged+ngram vs paged+draft on the chat mix and on copy-heavy
    requests (``lengths`` output tokens), one request at a time (batch 1, ``n // 16`` requests)
    and at the concurrency cap (``n`` requests, all at once). Speed-up is output tok/s over plain
    paged's on the same requests. Notebook 06 runs it small, and its quick run (the tests') with
    ``warmup=False``: each engine's first run then also pays one-off costs, and its speed-ups
    only show that the table is filled."""
    from ..workload import CHAT_MIX, make_copy_workload, make_workload

    cap = options.get("max_num_seqs", 64)
    workloads = {"chat": make_workload(n, seed, categories=CHAT_MIX, short=lengths,
                                       long=lengths),
                 "copy": make_copy_workload(n, seed, lengths=lengths)}
    rows = []
    for wl, items in workloads.items():
        for batch in (1, cap):
            work = items[:max(2, n // 16)] if batch == 1 else items
            base = None
            for name in SPEC_ENGINES:
                opts = {**options, "max_num_seqs": batch}
                if warmup:
                    run_engine(model, name, warmup_items(items), opts, progress=False)
                res = run_engine(model, name, work, opts, progress=False)
                m, sp = res.metrics, res.metrics.extra.get("speculative", {})
                base = base or m.output_tok_s
                rows.append({"engine": name, "workload": wl, "batch": batch,
                             "requests": len(work), "output_tok_s": m.output_tok_s,
                             "speedup_vs_paged": m.output_tok_s / base,
                             "tpot_p50_s": m.tpot_p50_s, **{k: sp.get(k) for k in (
                                 "acceptance_rate", "tokens_per_step", "propose_ms", "verify_ms",
                                 "num_proposed", "num_accepted")}})
                print(f"  {wl:5s} batch {batch:3d} {name:12s} {m.output_tok_s:7.1f} tok/s "
                      f"({rows[-1]['speedup_vs_paged']:.2f}x)", flush=True)
    print(format_spec_table(rows))
    return {"rows": rows}


def format_spec_table(rows: list[dict]) -> str:
    head = ["engine", "workload", "batch", "tok/s", "vs paged", "accept %", "tokens/step",
            "propose ms", "verify ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        spec = r["acceptance_rate"] is not None
        lines.append("| " + " | ".join([
            r["engine"], r["workload"], str(r["batch"]), f"{r['output_tok_s']:.1f}",
            f"{r['speedup_vs_paged']:.2f}x",
            f"{100 * r['acceptance_rate']:.0f}" if spec else "-",
            f"{r['tokens_per_step']:.2f}" if spec else "1",
            f"{r['propose_ms']:.0f}" if spec else "-",
            f"{r['verify_ms']:.0f}" if spec else "-"]) + " |")
    return "\n".join(lines)


# --- entry point ---------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    from ..llm import check_threads
    from ..models import dtype_name, load_model
    from ..workload import CHAT_MIX, make_workload

    if args.rounds is not None and args.rounds < 1:
        print(f"error: --rounds must be >= 1, got {args.rounds}")
        return 2
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ALL_ENGINES]
    if bad:
        print(f"unknown engine(s) {', '.join(bad)}: choose from {', '.join(ALL_ENGINES)}")
        return 2
    options = {"batch_size": args.max_batch, "max_num_seqs": args.max_batch, **options_from(args)}
    n = args.requests or (128 if args.quick else 256)
    n_naive = args.naive_requests or (6 if args.quick else 8)
    torch.manual_seed(args.seed)
    torch.set_num_threads(check_threads(args.threads or torch.get_num_threads()))
    model = load_model(args.model, dtype=args.dtype)
    items = make_workload(n, args.seed, rate=args.rate,
                          categories=None if args.long_prompts else CHAT_MIX)
    print(f"workload: {n} requests ({n_naive} for naive engines), "
          f"{sum(it.params.max_tokens for it in items)} output tokens, "
          f"arrivals {'all at t=0' if not args.rate else f'Poisson {args.rate}/s'}")
    try:
        if args.rounds and args.rounds > 1:
            from .offline_rounds import run_rounds
            rows = run_rounds(model, engines, items, items[:n_naive], options, args.rounds)
        else:
            rows = run_table(model, engines, items, items[:n_naive], options)
    except PeerError as e:             # vLLM cannot run here, or died: in its own words
        print(f"error: {e}")
        return 1
    print()
    print(format_table(rows))
    results = {"model": args.model, "dtype": dtype_name(model.dtype), "requests": n, "naive_requests": n_naive, "rate": args.rate,
               "seed": args.seed, "quick": args.quick, "torch_threads": torch.get_num_threads(),
               "table": rows, "experiments": {}}
    exps = [e for e in args.experiments.split(",") if e in EXPERIMENTS]
    runners = {"prefix": exp_prefix, "parallel": exp_parallel, "capacity": exp_capacity,
               "speculative": exp_speculative, "kv_dtype": exp_kv_dtype}
    sizes = {"prefix": 16, "parallel": 8, "capacity": 32, "speculative": 64, "kv_dtype": 128} \
        if args.quick else {"prefix": 32, "parallel": 16, "capacity": 64, "speculative": 128,
                            "kv_dtype": 256}
    for name in exps:
        print(f"\nexperiment {name} ...", flush=True)
        results["experiments"][name] = r = runners[name](model, sizes[name], args.seed, options)
        print(json.dumps(r, indent=1))
    out = Path(args.json) if args.json else FIGURES / "bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"\nresults -> {out}")
    if not args.no_figure:
        from ..viz.plots import plot_bench
        path = plot_bench(results, FIGURES / "bench.png")
        print(f"figure  -> {path}")
    return 0
