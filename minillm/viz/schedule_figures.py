"""Notebook 03's pictures of the scheduler at work, drawn from real ``PagedEngine`` runs.

``run_by_steps`` adds requests at given engine *steps* (not seconds), so a run is the same on
every machine; ``prefill_decode_figure`` shows decodes riding along with a long prompt's chunks
(chunked prefill, split-fuse), ``priority_figure`` a late high-priority request getting ahead, and
``preemption_figure`` preemptions marked on the request timeline. Nothing here schedules: it reads
what the engine did (``StepRecord``s, snapshots).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..runtime.driver import Driver, ScheduledArrivals, StepClock
from ..memory import MemorySnapshot
from ..metrics import StepRecord
from ..request import Request
from .block_figures import FS, label_axes, timeline
from .plots import BLUE, ORANGE, RED, new_figure, request_timeline

# --- 5. requests arriving at given steps; chunked prefill, priorities, preemption ------------
def run_by_steps(llm, arrivals: list[tuple[int, Request]], on_step=None) -> list[StepRecord]:
    """Like ``LLM.run`` but each request arrives at an engine *step* (added once that many steps
    have run), not a second: the run is the same on every machine. Returns the StepRecords."""
    engine = llm.engine
    stepped = None if on_step is None else lambda out, record: on_step(engine.snapshot(), record)
    driver = Driver(engine, StepClock("admit"), ScheduledArrivals(arrivals), on_step=stepped,
                    rejects=())                   # a request that can never run: its error, raised
    return driver.run().steps


def prefill_decode_figure(records: list[StepRecord], snapshots: list[MemorySnapshot] | None = None,
                          budget: int | None = None) -> Figure:
    """Per step, stacked: prompt (prefill) tokens and decode tokens computed; with ``snapshots``,
    the request timeline beside it."""
    fig = new_figure((12, 4.2))
    ax, ax_tl = fig.subplots(1, 2) if snapshots else (fig.subplots(), None)
    steps = [r.step for r in records]
    dec = [r.num_decode_tokens for r in records]
    ax.bar(steps, dec, color=BLUE, label="decode tokens (1 per running sequence)")
    ax.bar(steps, [r.num_prefill_tokens for r in records], bottom=dec, color=ORANGE,
           label="prefill tokens (prompt chunks)")
    if budget:
        ax.axhline(budget, color="black", ls=":", lw=1, label=f"token budget ({budget})")
    label_axes(ax, "chunked prefill: decodes ride along with the prompt's chunks",
           "tokens computed in the step", 1)
    if ax_tl is not None:
        timeline(snapshots, ax_tl, "who holds KV memory, step by step")
    fig.tight_layout()
    return fig


def priority_figure(runs: Mapping[str, list[MemorySnapshot]], late: Mapping[str, Request]) -> Figure:
    """One request timeline per policy (``runs``: policy -> snapshots), the arrival of that run's
    ``late`` request (policy -> Request) marked."""
    fig = new_figure((12, 4.4))
    for ax, (policy, snaps) in zip(np.atleast_1d(fig.subplots(1, len(runs))), runs.items()):
        req = late[policy]
        ids = timeline(snaps, ax, f'policy="{policy}"', lambda ax, ids: [ax.axvline(
            req.added_step + 0.5, color=RED, ls="--", lw=2,
            label=f"request {req.request_id} (priority {req.priority}) arrives")])
        ax.get_yticklabels()[ids.index(req.request_id)].set_color(RED)
        handles = ax.get_legend().legend_handles
        ax.get_legend().remove()
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def preemption_events(snapshots: list[MemorySnapshot],
                      records: list[StepRecord]) -> list[tuple[int, str]]:
    """(step, request id) of each preemption the StepRecords count (``num_preemptions`` rose): a
    request that held KV before the step and none after it, unfinished. One that holds KV again
    later surely was; one that never does either finished, or was preempted and later recomputed
    and finished within one step: the records' count decides (a tie goes to the newest, which is
    whom fcfs preempts)."""
    ids, states = request_timeline(snapshots)
    held = states != 0
    count = np.diff([0] + [r.num_preemptions for r in records])
    events = []
    for t in range(1, len(snapshots)):
        gone = [r for r in range(len(ids)) if held[r, t - 1] and not held[r, t]]
        back = [r for r in gone if held[r, t + 1:].any()]
        rest = [r for r in gone if r not in back]
        n = min(len(rest), max(0, int(count[t]) - len(back)))
        events += [(snapshots[t].step, ids[r]) for r in sorted(back + rest[len(rest) - n:])]
    return events


def preemption_figure(snapshots: list[MemorySnapshot], records: list[StepRecord],
                      title: str = "who holds KV memory; × = preempted") -> Figure:
    """``plot_timeline`` with a × where a request was preempted, and (on top) the engine's own
    preemption count per step from the StepRecords."""
    fig = new_figure((12, 5))
    ax_n, ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 3]})
    ev = preemption_events(snapshots, records)
    timeline(snapshots, ax, "", lambda ax, ids: [ax.scatter(
        [s for s, _ in ev], [ids.index(r) for _, r in ev], marker="X", s=140, color=ORANGE,
        edgecolor="black", zorder=3, gid="preempted", label="preempted: all its blocks freed")])
    per_step = np.diff([0] + [r.num_preemptions for r in records])
    ax_n.bar([r.step for r in records], per_step, color=ORANGE)
    ax_n.set_ylabel("preemptions\n(StepRecords)", fontsize=9)
    ax_n.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_n.set_title(title, fontsize=FS)
    fig.tight_layout()
    return fig
