"""Busy and bubble fractions of each pipeline rank with 1, 2, 4 micro-batches in flight
(notebook 07 draws the same runs as Gantt charts).

    python -m minillm.bench.pipeline --model smollm2-135m-instruct --stages 2 \\
        --microbatches 1,2,4 --requests 16 --gantt pipeline.png

One pipeline is launched and the same workload (``minillm.workload``, greedy, fixed lengths) is run
once per micro-batch count (``num_microbatches`` is rank 0's alone: it changes between runs). A
single-process paged engine runs it too, for the throughput it is compared with and to check the
tokens are equal.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..metrics import RunMetrics
from ..workload import make_workload, to_requests
from ..engines.r7_pipeline.timeline import Event, RankSummary, format_summary, summarize


@dataclass
class Measurement:
    label: str
    microbatches: int           # 0: the single-process paged engine
    metrics: RunMetrics
    tokens: list[list[int]]
    events: list[Event]

    @property
    def output_tok_s(self) -> float:
        return self.metrics.output_tok_s

    @property
    def duration_s(self) -> float:
        return self.metrics.duration_s

    @property
    def ranks(self) -> list[RankSummary]:
        return summarize(self.events)


def run_pipeline(llm, items, microbatches: list[int]) -> list[Measurement]:
    """The workload on ``llm``'s pipeline once per micro-batch count, after one warm-up run."""
    engine = llm.engine
    engine.num_microbatches = max(microbatches)
    llm.run(to_requests(llm, items[:2]))     # warm-up: the first forward of each rank is slow
    out = []
    for mb in microbatches:
        engine.num_microbatches = mb
        engine.clear_timeline()
        result = llm.run(to_requests(llm, items))
        out.append(Measurement(f"{engine.comm.world_size} stages, {mb} in flight", mb,
                               result.metrics, [o.token_ids for o in result.outputs],
                               engine.timeline()))
    return out


def run_single(llm, items) -> Measurement:
    llm.run(to_requests(llm, items[:2]))
    result = llm.run(to_requests(llm, items))
    return Measurement("single process", 0, result.metrics,
                       [o.token_ids for o in result.outputs], [])


def report(runs: list[Measurement]) -> str:
    lines = []
    for m in runs:
        lines.append(f"== {m.label}: {m.output_tok_s:.1f} output tok/s, {m.duration_s:.2f} s, "
                     f"time per output token p50 {m.metrics.tpot_p50_s * 1000:.0f} ms")
        if m.events:
            lines.append(format_summary(m.events))
    return "\n".join(lines)


def plot_runs(runs: list[Measurement], path: str | None = None):
    import matplotlib.pyplot as plt

    from ..engines.r7_pipeline.timeline import plot_gantt

    piped = [m for m in runs if m.events]
    fig, axes = plt.subplots(len(piped), 1, figsize=(11, 1.6 + 1.3 * len(piped)), squeeze=False)
    for ax, m in zip(axes[:, 0], piped):
        plot_gantt(m.events, ax=ax, title=m.label + ",")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def main(argv: list[str] | None = None) -> int:
    from ..llm import LLM

    p = argparse.ArgumentParser(prog="python -m minillm.bench.pipeline",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", default="1,2,4")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32, help="every request's output length")
    p.add_argument("--threads", type=int, default=1, help="torch threads of every rank")
    p.add_argument("--gantt", help="save the Gantt charts to this PNG")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    mbs = [int(x) for x in args.microbatches.split(",")]
    items = make_workload(args.requests, seed=0, short=(args.max_tokens, args.max_tokens),
                          p_long=0.0)
    single = LLM(args.model, engine="paged")
    runs = [run_single(single, items)]
    llm = LLM(single.model, pipeline_parallel_size=args.stages, worker_threads=args.threads)
    runs += run_pipeline(llm, items, mbs)
    llm.engine.close()
    print(report(runs))
    same = all(m.tokens == runs[0].tokens for m in runs)
    print(f"tokens equal to the single-process engine in every run: {same}")
    if args.gantt:
        plot_runs(runs, args.gantt)
        print(f"Gantt charts -> {args.gantt}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
