"""Interference, measured: steady decodes while long prompts arrive, in one engine and
disaggregated (notebook 11; docs/rungs/11_disagg.md's table).

    python -m minillm.bench.disagg --model smollm2-135m-instruct \\
        --steady 8 --long 6 --long-len 512 --long-every 0.6

``steady`` requests (short prompts, long answers) all arrive at the start; ``long`` ones (long
prompts, short answers) arrive every ``--long-every`` seconds after a warm second. The same
requests, at the same offsets, run on the paged engine (one process, ``--threads`` x 2 torch
threads: the same cores) and on the disagg engine (its decode side and its prefill worker one
``--threads`` each), overlapped and in lockstep. Reported per class: TTFT P50/P99, TPOT P50/P99,
and the decode steps' inter-token gaps (ITL) P50/P99, which is where a long prefill shows as a
spike; for disagg, the KV bytes moved per long request and the transfer time.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from ..request import Request, SamplingParams


@dataclass(frozen=True)
class Workload:
    steady: int = 8
    steady_len: int = 16
    steady_tokens: int = 128
    long: int = 6
    long_len: int = 512
    long_tokens: int = 8
    long_every_s: float = 0.6
    first_long_s: float = 1.0
    seed: int = 0

    def requests(self, vocab: int, tag: str) -> list[Request]:
        rng = random.Random(self.seed)
        ids = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]   # noqa: E731
        out = [Request(ids(self.steady_len), SamplingParams(max_tokens=self.steady_tokens,
                                                            ignore_eos=True),
                       request_id=f"{tag}-steady-{i}") for i in range(self.steady)]
        for i in range(self.long):
            r = Request(ids(self.long_len), SamplingParams(max_tokens=self.long_tokens,
                                                           ignore_eos=True),
                        request_id=f"{tag}-long-{i}")
            r.arrival_offset_s = self.first_long_s + i * self.long_every_s
            out.append(r)
        return out


@dataclass
class Measurement:
    label: str
    ttft_ms: dict[str, tuple[float, float]]      # class -> (P50, P99)
    tpot_ms: dict[str, tuple[float, float]]
    itl_ms: tuple[float, float]                  # decode steps' gaps while steady ones run
    output_tok_s: float
    tokens: dict[str, list[int]]
    transfer_kib: float = 0.0                    # mean per long request (disagg)
    transfer_ms: float = 0.0
    recomputed: int = 0
    extra: dict = field(default_factory=dict)


def p50_p99(xs) -> tuple[float, float]:
    a = np.asarray([x for x in xs if x is not None] or [np.nan], dtype=float)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def measure(engine, workload: Workload, label: str) -> Measurement:
    """One run of the workload on ``engine`` (after a short warm-up run)."""
    vocab = engine.model.hf_model.config.vocab_size
    engine.run(Workload(steady=2, steady_tokens=4, long=1, first_long_s=0.0,
                     long_len=32).requests(vocab, f"warm-{label}"))
    result = engine.run(workload.requests(vocab, label))
    outs = {o.request_id.split("-", 1)[1]: o for o in result.outputs}
    cls = {k: [o for rid, o in outs.items() if rid.startswith(k)] for k in ("steady", "long")}
    steady_done = max(o.latency_s for o in cls["steady"])
    times = [s.time_s for s in result.steps if s.num_decode_tokens and s.time_s <= steady_done]
    gaps = np.diff(times) * 1000 if len(times) > 1 else []
    m = Measurement(label,
                    {k: tuple(x * 1000 for x in p50_p99(o.ttft_s for o in v))
                     for k, v in cls.items()},
                    {k: tuple(x * 1000 for x in p50_p99(o.tpot_s for o in v))
                     for k, v in cls.items()},
                    p50_p99(gaps), result.metrics.output_tok_s,
                    {rid: o.token_ids for rid, o in outs.items()})
    transfers = [t for rid, t in getattr(engine, "transfers", {}).items()
                 if rid.startswith(f"{label}-long")]
    m.extra["itl_series"] = (list(times[1:]), list(gaps))
    if transfers:
        m.transfer_kib = float(np.mean([t.nbytes for t in transfers])) / 1024
        m.transfer_ms = float(np.mean([t.seconds for t in transfers])) * 1000
        m.recomputed = sum(not t.landed for t in transfers)
    return m


def table(runs: list[Measurement]) -> str:
    lines = ["| engine | steady TPOT P50 / P99 (ms) | steady ITL P50 / P99 (ms) | steady TTFT "
             "P50 / P99 (ms) | long TTFT P50 / P99 (ms) | output tok/s | KV moved per long "
             "request | transfer (ms) | tokens equal |", "|---" * 9 + "|"]
    base = runs[0].tokens
    for m in runs:
        same = sum(m.tokens.get(k) == v for k, v in base.items())
        moved = f"{m.transfer_kib:,.0f} KiB" if m.transfer_kib else "—"
        lines.append(
            f"| {m.label} | {m.tpot_ms['steady'][0]:.1f} / {m.tpot_ms['steady'][1]:.1f} | "
            f"{m.itl_ms[0]:.1f} / {m.itl_ms[1]:.1f} | {m.ttft_ms['steady'][0]:.0f} / "
            f"{m.ttft_ms['steady'][1]:.0f} | {m.ttft_ms['long'][0]:.0f} / "
            f"{m.ttft_ms['long'][1]:.0f} | {m.output_tok_s:.1f} | {moved} | "
            f"{m.transfer_ms:.1f} | {same}/{len(base)} |")
    return "\n".join(lines)


def plot_itl(runs: list[Measurement], ax=None, arrivals: list[float] = ()):
    """Each run's gaps between decode steps while the steady requests run, over time: a long
    prompt's prefill in the same engine shows as a spike; ``arrivals``: the long ones' offsets."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(9, 3.2))[1]
    for m in runs:
        t, gaps = m.extra["itl_series"]
        ax.plot(t, gaps, lw=1, label=m.label)
    for a in arrivals:
        ax.axvline(a, color="0.6", lw=0.8, ls=":")
    ax.set_xlabel("seconds since the run started (dotted: a long prompt arrives)")
    ax.set_ylabel("gap between decode steps (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize="small")
    return ax


def main(argv: list[str] | None = None) -> int:
    from ..core.engine import PagedEngine
    from ..models import load_model
    from ..engines.r11_disagg.engine import DisaggEngine

    p = argparse.ArgumentParser(prog="python -m minillm.bench.disagg",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steady", type=int, default=8)
    p.add_argument("--steady-tokens", type=int, default=128)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--long-len", type=int, default=512)
    p.add_argument("--long-every", type=float, default=0.6)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = p.parse_args(argv)
    w = Workload(steady=args.steady, steady_tokens=args.steady_tokens, long=args.long,
                 long_len=args.long_len, long_every_s=args.long_every)
    model = load_model(args.model)
    common = dict(max_num_batched_tokens=args.max_num_batched_tokens)
    runs = []
    torch.set_num_threads(2 * args.threads)
    runs.append(measure(PagedEngine(model, **common), w, "paged (one process)"))
    torch.set_num_threads(args.threads)
    for lockstep in (False, True):
        engine = DisaggEngine(model, worker_threads=args.threads, lockstep=lockstep, **common)
        try:
            runs.append(measure(engine, w, "disagg" + (", lockstep" if lockstep else "")))
        finally:
            engine.close()
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
