"""What each pipeline rank did, and when: compute, waits, idle — and the bubbles (notebook 07).

Every rank records spans as it runs: ``compute`` (its slice of the layers), ``schedule`` (rank 0
only: forming a micro-batch, sampling, committing tokens), ``recv`` (waiting for hidden states,
metadata or logits), ``send`` (waiting for a send to complete). The time a rank spends in none of
them is ``idle``. Rank 0 gathers every rank's events at the end (``PipelineEngine.timeline``).

A rank's *busy fraction* is its compute + schedule time over the common window (first event of
any rank to last event of any rank); its *bubble fraction* is the rest: time spent waiting for a
neighbour or idle. With one micro-batch in flight, each stage works 1/P of the time at best;
several micro-batches in flight fill the bubbles. Times are ``time.time()`` so that ranks on
different machines can be compared (as well as their clocks agree).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...dist.timeline import Event

BUSY = ("compute", "schedule")
KINDS = ("compute", "schedule", "recv", "send")
COLORS = {"compute": "tab:blue", "schedule": "tab:green", "recv": "tab:red", "send": "tab:orange"}






@dataclass
class RankSummary:
    rank: int
    window_s: float
    seconds: dict[str, float]      # per kind, plus "idle"

    @property
    def busy_fraction(self) -> float:
        return sum(self.seconds[k] for k in BUSY) / self.window_s if self.window_s else 0.0

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_fraction if self.window_s else 0.0


def summarize(events: list[Event]) -> list[RankSummary]:
    """Per-rank seconds by kind over the common window, idle included."""
    if not events:
        return []
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    out = []
    for rank in sorted({e.rank for e in events}):
        secs = {k: 0.0 for k in KINDS}
        for e in events:
            if e.rank == rank:
                secs[e.kind] += e.end - e.start
        secs["idle"] = max(0.0, (t1 - t0) - sum(secs.values()))
        out.append(RankSummary(rank, t1 - t0, secs))
    return out


def bubble_fraction(events: list[Event]) -> float:
    """The pipeline's bubble fraction: the mean over ranks of the time not spent working."""
    ranks = summarize(events)
    return sum(r.bubble_fraction for r in ranks) / len(ranks) if ranks else 0.0


def format_summary(events: list[Event]) -> str:
    lines = [f"{'rank':>4} {'busy':>6} {'bubble':>7} " + " ".join(f"{k:>9}" for k in KINDS)
             + f" {'idle':>9}  (seconds over a {summarize(events)[0].window_s:.3f} s window)"
             if events else "no events"]
    for r in summarize(events):
        lines.append(f"{r.rank:>4} {r.busy_fraction:>6.1%} {r.bubble_fraction:>7.1%} "
                     + " ".join(f"{r.seconds[k]:>9.4f}" for k in (*KINDS, "idle")))
    if events:
        lines.append(f"pipeline bubble fraction (mean over ranks): {bubble_fraction(events):.1%}")
    return "\n".join(lines)


def plot_gantt(events: list[Event], ax=None, title: str = ""):
    """A Gantt chart: one row per rank, one bar per span, colored by kind; white is idle.
    Compute bars are labeled with their micro-batch, so the pipeline's diagonal shows."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1 + 0.6 * len({e.rank for e in events})))
    t0 = min((e.start for e in events), default=0.0)
    for e in events:
        left, width = (e.start - t0) * 1000, (e.end - e.start) * 1000
        ax.barh(e.rank, width, left=left, height=0.6, color=COLORS[e.kind], linewidth=0)
    ranks = sorted({e.rank for e in events})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()]
              + [Patch(facecolor="white", edgecolor="gray", label="idle")],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small")
    bubble = bubble_fraction(events)
    ax.set_title(f"{title}  bubble fraction {bubble:.0%}".strip())
    return ax
