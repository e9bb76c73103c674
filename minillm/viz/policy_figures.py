"""Notebook 08's pictures of the scheduling policies, drawn from real runs (engines/r8_policies).

``PolicyRecorder`` watches a run from outside, step by step: the waiting queue's order, who runs,
who was evicted for whom (the engine's ``"preempted"`` observer event) and each request's first
token — all in engine steps, so a run is the same on every machine. ``gantt_figure`` draws one
request timeline per policy with the classes coloured; ``class_ttft_figure`` the time to first
token per class; ``starvation_figure`` a starved request's wait under ``priority`` against the
bound under ``score``. Nothing here schedules: it reads what the scheduler did.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from matplotlib.figure import Figure

from ..request import Request
from .block_figures import timeline
from .plots import BLUE, ORANGE, RED, new_figure  # noqa: F401 (notebook 08 draws with them)

CLASS_COLORS = {0: RED, 1: BLUE}     # priority 0 (interactive), 1 (batch)


class PolicyRecorder:
    """An engine observer (``engine.observers``): in each step, once the forward ran, who computed
    and who waits (in policy order), and every eviction; and ``on_step(snapshot, record)`` for
    ``schedule_figures.run_by_steps``: first tokens, then the next view (``then``)."""

    def __init__(self, engine, requests: list[Request], then=None):
        self.engine, self.requests, self.then = engine, requests, then
        self.queues: list[list[str]] = []       # per step: who waits, in the order it is served
        self.running: list[list[str]] = []      # per step: who computes in it
        self.first_token_step: dict[str, int] = {}
        self.evictions: list[tuple[int, str, str]] = []   # (step, victim, for whom)
        engine.observers.add(self._event)

    def _event(self, event) -> None:
        if event.phase == "preempted":
            self.evictions.append((event.step, event.request_id, event.data))
        elif event.phase == "computed":     # scheduled and computed, nothing committed yet
            sched = self.engine.scheduler
            self.queues.append([g.request.request_id for g in sched.waiting])
            self.running.append([g.request.request_id for g in sched.running])

    def __call__(self, snapshot, record=None) -> None:
        step = self.engine.step_count
        for r in self.requests:
            if r.request_id not in self.first_token_step and r.output_token_ids:
                self.first_token_step[r.request_id] = step
        if self.then is not None:
            self.then(snapshot, record)

    def ttft_steps(self) -> dict[str, int]:
        """Steps from arrival (``added_step``) to the first token, per request."""
        return {r.request_id: self.first_token_step[r.request_id] - r.added_step
                for r in self.requests if r.request_id in self.first_token_step}

    def queue_table(self, steps: int = 12) -> str:
        """The first ``steps`` steps: who runs, and the waiting queue in the order it is served."""
        rows = [f"{'step':>4}  {'running':<28} waiting (served in this order)"]
        for i, (run, wait) in enumerate(zip(self.running[:steps], self.queues[:steps])):
            rows.append(f"{i + 1:>4}  {' '.join(run):<28} {' '.join(wait) or '-'}")
        return "\n".join(rows)


def gantt_figure(runs: Mapping[str, tuple[list, list[Request]]]) -> Figure:
    """One request timeline per policy (``runs``: policy -> (snapshots, requests)); each
    request's label is coloured by its priority class."""
    fig = new_figure((5.2 * len(runs), 4.6))
    for ax, (policy, (snaps, reqs)) in zip(np.atleast_1d(fig.subplots(1, len(runs))),
                                           runs.items()):
        ids = timeline(snaps, ax, f'policy="{policy}"')
        prio = {r.request_id: r.priority for r in reqs}
        for label, rid in zip(ax.get_yticklabels(), ids):
            label.set_color(CLASS_COLORS.get(prio.get(rid), "black"))
        handles = ax.get_legend().legend_handles
        ax.get_legend().remove()                # one legend for all: the policies share it
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    fig.suptitle("who holds KV memory, step by step (red labels: interactive, priority 0; "
                 "blue: batch, priority 1)", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def class_ttft_figure(ttfts: Mapping[str, dict[str, int]], requests: list[Request]) -> Figure:
    """Mean and worst steps to the first token, per policy and class."""
    fig = new_figure((10, 3.6))
    ax = fig.subplots()
    prio = {r.request_id: r.priority for r in requests}
    classes = sorted(set(prio.values()))
    width = 0.8 / len(classes)
    for k, c in enumerate(classes):
        mean, worst = [], []
        for t in ttfts.values():
            vals = [v for rid, v in t.items() if prio[rid] == c] or [0]
            mean.append(np.mean(vals))
            worst.append(max(vals))
        x = np.arange(len(ttfts)) + k * width
        name = "interactive (priority 0)" if c == 0 else f"batch (priority {c})"
        ax.bar(x, worst, width, color=CLASS_COLORS.get(c, ORANGE), alpha=0.35,
               label=f"{name}: worst")
        ax.bar(x, mean, width, color=CLASS_COLORS.get(c, ORANGE), label=f"{name}: mean")
    ax.set_xticks(np.arange(len(ttfts)) + width * (len(classes) - 1) / 2, list(ttfts))
    ax.set_ylabel("steps from arrival to first token")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)      # room for the legend above the bars
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    fig.tight_layout()
    return fig


def starvation_figure(waits: Mapping[str, int | None], horizon: int, bound: int) -> Figure:
    """Steps a low-priority request waited for its first step under each policy (None: still
    waiting when the run stopped at ``horizon``), with the ``score`` bound drawn."""
    fig = new_figure((8, 3.2))
    ax = fig.subplots()
    names = list(waits)
    vals = [horizon if w is None else w for w in waits.values()]
    bars = ax.barh(names, vals, color=[RED if w is None else BLUE for w in waits.values()])
    for bar, w in zip(bars, waits.values()):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                "  never admitted (run stopped)" if w is None else f"  {w} steps", va="center")
    ax.axvline(bound, color="black", ls="--", lw=1.5, label=f"score's bound: {bound} steps")
    ax.set_xlim(0, horizon * 1.35)
    ax.set_xlabel("steps the low-priority request waited (one urgent arrival per step)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig
