"""Tensor vs pipeline parallelism on one workload: tokens, throughput, time to first token,
all-reduce share and KV bytes per rank (notebook 10; docs/rungs/10_tensor.md's table).

    python -m minillm.bench.tensor_parallel --model smollm2-135m-instruct \\
        --layouts 1x1,1x2,3x1,3x2 --requests 16 --max-tokens 32

A layout ``TxP`` is T tensor-parallel ranks per stage and P stages (``1x1``: the single-process
paged engine, run with ``--single-threads`` torch threads; every other rank gets ``--threads``).
Each layout runs the same greedy workload (``minillm.workload``) after a two-request warm-up.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import torch

from ..metrics import RunMetrics
from ..workload import make_workload, to_requests
from ..engines.r7_pipeline.timeline import Event
from ..engines.r10_tensor.timeline import all_reduce_share, format_summary
from ..engines.r10_tensor.traffic import measure_all_reduce


@dataclass
class Layout:
    tensor: int
    pipeline: int

    @property
    def label(self) -> str:
        return f"T={self.tensor} x P={self.pipeline}"

    @property
    def options(self) -> dict:
        if self.tensor == 1 and self.pipeline == 1:
            return {}
        if self.tensor == 1:
            return {"pipeline_parallel_size": self.pipeline, "num_microbatches": self.pipeline}
        return {"tensor_parallel_size": self.tensor, "pipeline_parallel_size": self.pipeline}


@dataclass
class Measurement:
    layout: Layout
    metrics: RunMetrics
    tokens: list[list[int]]
    events: list[Event] = field(default_factory=list)
    kv_bytes_per_rank: list[int] = field(default_factory=list)

    @property
    def all_reduce_share(self) -> float:
        return all_reduce_share(self.events) if self.layout.tensor > 1 else 0.0


def parse_layouts(text: str) -> list[Layout]:
    out = []
    for part in text.split(","):
        t, _, p = part.strip().partition("x")
        if not (t.isdigit() and p.isdigit()) or int(t) < 1 or int(p) < 1:
            raise ValueError(f"--layouts: {part!r} is not TxP with T, P >= 1 (e.g. 3x1)")
        out.append(Layout(int(t), int(p)))
    return out


def measure(model, layout: Layout, items, threads: int = 1) -> Measurement:
    """One layout: launch it, warm up, run the workload, gather its timeline, close it."""
    from ..llm import LLM

    extra = {"worker_threads": threads} if layout.options else {}
    llm = LLM(model, **layout.options, **extra)
    engine = llm.engine
    try:
        llm.run(to_requests(llm, items[:2]))          # the first forward of each rank is slow
        if layout.options:
            engine.clear_timeline()
        result = llm.run(to_requests(llm, items))
        events = engine.timeline() if layout.options else []
        per_rank = engine.kv_bytes_per_rank() if layout.options else [engine.kv_bytes_per_token]
        return Measurement(layout, result.metrics, [o.token_ids for o in result.outputs], events,
                           per_rank)
    finally:
        if layout.options:
            engine.close()


def table(runs: list[Measurement]) -> str:
    base = runs[0].tokens
    lines = ["| T x P | ranks | output tok/s | TTFT p50 (ms) | all-reduce share | KV bytes/token "
             "per rank | tokens equal to 1x1 |", "|---|---|---|---|---|---|---|"]
    for m in runs:
        kv = " / ".join(str(b) for b in sorted(set(m.kv_bytes_per_rank)))
        lines.append(f"| {m.layout.tensor} x {m.layout.pipeline} | "
                     f"{m.layout.tensor * m.layout.pipeline} | {m.metrics.output_tok_s:.1f} | "
                     f"{m.metrics.ttft_p50_s * 1000:.0f} | {m.all_reduce_share:.0%} | {kv} | "
                     f"{sum(a == b for a, b in zip(m.tokens, base))}/{len(base)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..models import load_model

    p = argparse.ArgumentParser(prog="python -m minillm.bench.tensor_parallel",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--layouts", default="1x1,1x2,3x1,3x2")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32, help="every request's output length")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every parallel rank")
    p.add_argument("--single-threads", type=int, default=os.cpu_count(),
                   help="torch threads of the single-process engine (1x1)")
    p.add_argument("--links", default="2,3", help="also time the all-reduce alone among this "
                   "many processes, both ways (comma-separated; empty: skip)")
    args = p.parse_args(argv)
    layouts = parse_layouts(args.layouts)
    model = load_model(args.model)
    items = make_workload(args.requests, seed=0, short=(args.max_tokens, args.max_tokens),
                          p_long=0.0)
    runs = []
    for layout in layouts:
        torch.set_num_threads(args.single_threads if not layout.options else args.threads)
        runs.append(measure(model, layout, items, args.threads))
        if runs[-1].events:
            print(f"== {layout.label}\n{format_summary(runs[-1].events)}")
    print(table(runs))
    hidden = model.hf_model.config.hidden_size
    sizes = [hidden, 16 * hidden, 128 * hidden, 1024 * hidden]
    for world in [int(w) for w in args.links.split(",") if w.strip()]:
        timing = measure_all_reduce(world, sizes)
        print(f"all-reduce among {world} processes, microseconds (collective / exchange): " +
              ", ".join(f"{n} numbers {timing['collective', n] * 1e6:.0f} / "
                        f"{timing['exchange', n] * 1e6:.0f}" for n in sizes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
