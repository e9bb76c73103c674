"""Where each tensor-parallel rank's time goes: its own arithmetic vs the all-reduces (notebook 10).

Rung 7's timeline, with one more kind: every all-reduce is an ``all_reduce`` span recorded
*inside* the ``compute`` span of its micro-batch (two per layer). ``summarize`` takes them out of
``compute``, so each rank's seconds -- compute, all_reduce, schedule, recv, send, idle -- add up
to the window, and ``all_reduce_share`` is the part of the forward spent summing slices.
"""
from __future__ import annotations

from ..r7_pipeline.timeline import COLORS as PIPELINE_COLORS
from ..r7_pipeline.timeline import KINDS as PIPELINE_KINDS
from ..r7_pipeline.timeline import Event, RankSummary

KINDS = ("compute", "all_reduce", *PIPELINE_KINDS[1:])
COLORS = {**PIPELINE_COLORS, "all_reduce": "tab:purple"}


def summarize(events: list[Event]) -> list[RankSummary]:
    """Per-rank seconds by kind over the common window, all-reduces out of compute, idle added."""
    if not events:
        return []
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    out = []
    for rank in sorted({e.rank for e in events}):
        secs = {k: 0.0 for k in KINDS}
        for e in events:
            if e.rank == rank:
                secs[e.kind] += e.end - e.start
        secs["compute"] = max(0.0, secs["compute"] - secs["all_reduce"])
        secs["idle"] = max(0.0, (t1 - t0) - sum(secs.values()))
        out.append(RankSummary(rank, t1 - t0, secs))
    return out


def all_reduce_share(events: list[Event]) -> float:
    """The share of the ranks' forward time (compute + all-reduce) spent in all-reduces."""
    ranks = summarize(events)
    forward = sum(r.seconds["compute"] + r.seconds["all_reduce"] for r in ranks)
    return sum(r.seconds["all_reduce"] for r in ranks) / forward if forward else 0.0


def format_summary(events: list[Event]) -> str:
    ranks = summarize(events)
    if not ranks:
        return "no events"
    lines = [f"{'rank':>4} " + " ".join(f"{k:>10}" for k in (*KINDS, "idle"))
             + f"  (seconds over a {ranks[0].window_s:.3f} s window)"]
    lines += [f"{r.rank:>4} " + " ".join(f"{r.seconds[k]:>10.4f}" for k in (*KINDS, "idle"))
              for r in ranks]
    lines.append(f"all-reduce share of the forward (all ranks): {all_reduce_share(events):.1%}")
    return "\n".join(lines)


def plot_gantt(events: list[Event], ax=None, title: str = ""):
    """One row per rank: compute in blue, the all-reduces inside it in purple, waits in red and
    orange, white idle."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1 + 0.6 * len({e.rank for e in events})))
    t0 = min((e.start for e in events), default=0.0)
    for e in sorted(events, key=lambda e: e.kind == "all_reduce"):   # all-reduces drawn on top
        ax.barh(e.rank, (e.end - e.start) * 1000, left=(e.start - t0) * 1000, height=0.6,
                color=COLORS[e.kind], linewidth=0)
    ranks = sorted({e.rank for e in events})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in KINDS]
              + [Patch(facecolor="white", edgecolor="gray", label="idle")],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small")
    ax.set_title(f"{title}  all-reduce share {all_reduce_share(events):.0%}".strip())
    return ax
