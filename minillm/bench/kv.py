"""Rung 9's benchmark: the same KV bytes under each ``kv_cache_dtype`` (``make bench`` runs it as
experiment ``kv_dtype``; notebook 09 runs it small).

The budget is what a padded engine needs for ``rows`` (6) rows of the workload's longest request
in the model's dtype -- the main table's ``paged-kv-budget`` at 6 rows instead of 64, so that fp32
really is short of memory (at 16 rows it already ran 70 of the 128 requests at once, and every
narrower format all 128: a ratio capped by the workload, not by memory). Every format gets those bytes and no cap on concurrent requests
but the workload's size: how many requests run at once, and how fast, is then up to how many
tokens fit.
"""
from __future__ import annotations

from ..layers.kv_quant import get_format
from .run import run_engine, warmup_items

DTYPES = ("auto", "float16", "bfloat16", "int8", "fp8")


def budget_bytes(model, items, rows: int) -> int:
    """What ``rows`` padded rows of the workload's longest request take in the model's dtype."""
    from ..llm import LLM
    encoder = LLM(model, engine="naive")
    longest = max(len(encoder.encode(it.prompt)) + it.params.max_tokens for it in items)
    return rows * longest * model.kv_bytes_per_token


def exp_kv_dtype(model, n: int, seed: int, options: dict, rows: int = 6,
                 dtypes: tuple[str, ...] = DTYPES, progress: bool = False) -> dict:
    """One row per format at one KV budget: bytes per token, blocks, peak concurrent requests,
    output tok/s, preemptions; and the ratios of int8's to fp32's."""
    from ..workload import make_workload

    items = make_workload(n, seed)
    budget = budget_bytes(model, items, rows)
    out = []
    for name in dtypes:
        opts = {**options, "kv_cache_bytes": budget, "max_num_seqs": n, "kv_cache_dtype": name}
        run_engine(model, "paged", warmup_items(items), opts, progress=False)
        res = run_engine(model, "paged", items, opts, progress=progress)
        m = res.metrics
        per_token = get_format(name).bytes_per_token(*model.kv_geometry, model.dtype)
        out.append({"kv_cache_dtype": name, "bytes_per_token": per_token,
                    "kv_budget_bytes": budget, "num_blocks": budget // (options.get("block_size", 16) * per_token),
                    "requests_512_at_1gib": (1 << 30) // (512 * per_token),
                    "peak_concurrency": m.peak_concurrency, "output_tok_s": m.output_tok_s,
                    "preemptions": m.num_preemptions, "requests": len(items)})
        print(f"  kv_cache_dtype {name:9s} {per_token:6d} B/token  peak {m.peak_concurrency:3d} "
              f"requests at once  {m.output_tok_s:6.1f} tok/s  {m.num_preemptions} preemptions",
              flush=True)
    base = {r["kv_cache_dtype"]: r for r in out}
    result = {"rows": out, "budget_rows": rows}
    if "auto" in base and "int8" in base:
        result["int8_vs_auto_concurrency"] = (base["int8"]["peak_concurrency"] /
                                              base["auto"]["peak_concurrency"])
        result["int8_vs_auto_tok_s"] = base["int8"]["output_tok_s"] / base["auto"]["output_tok_s"]
    return result
