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
from ..r7_pipeline.timeline import summarize as summarize_pipeline

KINDS = ("compute", "all_reduce", *PIPELINE_KINDS[1:])
COLORS = {**PIPELINE_COLORS, "all_reduce": "tab:purple"}


def summarize(events: list[Event]) -> list[RankSummary]:
    """Rung 7's per-rank seconds by kind, the all-reduces taken out of compute (they are nested
    in it, so the window and the idle time are rung 7's)."""
    out = summarize_pipeline([e for e in events if e.kind != "all_reduce"])
    for r in out:
        reduce = sum(e.end - e.start for e in events if e.rank == r.rank and e.kind == "all_reduce")
        r.seconds = {"compute": max(0.0, r.seconds["compute"] - reduce), "all_reduce": reduce,
                     **{k: v for k, v in r.seconds.items() if k != "compute"}}
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


def per_layer(events: list[Event], rank: int = 0) -> list[dict[str, float]]:
    """Mean seconds per step spent on each of ``rank``'s layers (in its stage's order): the
    compute before the attention's all-reduce, that all-reduce, the MLP's compute, its all-reduce.
    Read from the spans alone: inside a ``compute`` span the 2k-th and (2k + 1)-th all-reduces are
    layer k's; the compute between two all-reduces is the next one's. Rank 0's last stretch (the
    final norm and the head, or nothing) is left out."""
    mine = sorted((e for e in events if e.rank == rank), key=lambda e: e.start)
    computes = [e for e in mine if e.kind == "compute"]
    reduces = [e for e in mine if e.kind == "all_reduce"]
    rows: list[dict[str, float]] = []
    steps = 0
    for c in computes:
        inside = [r for r in reduces if c.start <= r.start and r.end <= c.end]
        if not inside:
            continue
        steps += 1
        t = c.start
        for k, r in enumerate(inside):
            layer, part = divmod(k, 2)
            if layer == len(rows):
                rows.append({"attention": 0.0, "all_reduce_attention": 0.0, "mlp": 0.0,
                             "all_reduce_mlp": 0.0})
            name = "attention" if part == 0 else "mlp"
            rows[layer][name] += r.start - t
            rows[layer]["all_reduce_" + name] += r.end - r.start
            t = r.end
    return [{k: v / steps for k, v in row.items()} for row in rows] if steps else []


def plot_per_layer(events: list[Event], rank: int = 0, ax=None, title: str = ""):
    """Stacked bars, one per layer: its compute and its two all-reduces (ms per step)."""
    import matplotlib.pyplot as plt

    rows = per_layer(events, rank)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.2))
    bottom = [0.0] * len(rows)
    colors = {"attention": "tab:blue", "all_reduce_attention": "tab:purple", "mlp": "tab:cyan",
              "all_reduce_mlp": "plum"}
    for key, color in colors.items():
        heights = [r[key] * 1000 for r in rows]
        ax.bar(range(len(rows)), heights, bottom=bottom, color=color,
               label=key.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel(f"layer (rank {rank}'s stage)")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize="small", ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title(title or f"rank {rank}: compute and all-reduce per layer")
    return ax
