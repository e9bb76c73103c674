"""Live notebook views: watch KV memory while an engine runs, then scrub back through the run.

* ``LiveMemoryView`` is an ``on_step`` callback: ``llm.run(requests, on_step=view)``. Every
  ``every`` steps (and at most once per ``min_interval_s``) it redraws the KV memory map
  (``plots.plot_memory``) next to fragmentation over time, and it keeps every snapshot, so after
  the run its slider scrubs back to any step.
* ``FragmentationVisualizer`` is notebook 05: controls for a workload and the allocators of
  ``fragmentation.py``, a time slider, a table of waste per allocator, and loading of a trace
  recorded from a real engine run.

Figures are drawn with matplotlib's Agg canvas into PNG bytes shown by an ``ipywidgets.Image``.
Updating an image widget's value is all it takes, live in JupyterLab while a cell runs, headless
under nbclient, and in a browser alike; and the same ``figure()`` methods save PNGs for
``python -m minillm.viz.figures``.
"""
from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..memory import CACHED, FREE, PADDING, RESERVED, TOKEN, MemorySnapshot
from .fragmentation import (ALLOCATOR_LABELS, ALLOCATORS, LENGTH_DISTS, SimConfig, SimResult,
                            Trace, WorkloadSpec, compare, waste_breakdown)
from .plots import KIND_COLORS, OWNER_COLORS, plot_memory

WASTE_COLORS = {"token": "#4c78a8", "internal": KIND_COLORS[PADDING],
                "reserved": KIND_COLORS[RESERVED], "external": "#5b5b5b"}
WASTE_LABELS = {"token": "holding tokens", "internal": "internal (padding / last-block tail)",
                "reserved": "reserved for future tokens", "external": "external (unusable holes)"}
ALLOCATOR_COLORS = {"max-length": "#e45756", "exact": "#f58518", "paged": "#4c78a8"}


# --- drawing helpers (plain matplotlib, used by the widgets and by figures.py) ------------------
def new_figure(figsize=(12, 4)) -> Figure:
    """A figure outside pyplot: never shown twice by the inline backend, never leaked."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def render_png(fig: Figure, dpi: int = 72) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def as_address_space(snap: MemorySnapshot, blocks_per_row: int) -> MemorySnapshot:
    """A block pool redrawn as its flat address space, ``blocks_per_row`` blocks per row: the
    same slots, laid out like a contiguous arena of the same size, so the two compare at a glance.
    (A pool of hundreds of one-block rows is too thin to see.)"""
    nb, bs = snap.kind.shape
    rows = -(-nb // blocks_per_row)
    pad = rows * blocks_per_row - nb
    kind = np.concatenate([snap.kind, np.full((pad, bs), FREE, dtype=snap.kind.dtype)])
    owner = np.concatenate([snap.owner, np.full((pad, bs), -1, dtype=snap.owner.dtype)])
    return MemorySnapshot(snap.engine, snap.step, kind.reshape(rows, blocks_per_row * bs),
                          owner.reshape(rows, blocks_per_row * bs), snap.owners,
                          snap.bytes_per_slot, f"row of {blocks_per_row} block", None, snap.time_s,
                          {**snap.extra, "blocks_per_row": blocks_per_row, "block_size": bs})


def memory_legend_handles(external: bool = True) -> list[Patch]:
    """The legend of ``plot_memory`` (plus external holes), for one legend shared by panels."""
    handles = [Patch(color=OWNER_COLORS[0], label="token (colour = request)")] + \
        [Patch(color=KIND_COLORS[k], label=n) for k, n in ((PADDING, "padding / hole"),
                                                           (RESERVED, "reserved"),
                                                           (CACHED, "cached (free)"),
                                                           (FREE, "free"))]
    if external:
        handles.append(Patch(color=WASTE_COLORS["external"], label="external (hole too small)"))
    return handles


def draw_snapshot(snap: MemorySnapshot, ax, title: str | None = None, max_rows: int = 64,
                  legend: bool = True):
    """``plot_memory`` plus two things: a block pool with more than ``max_rows`` blocks is drawn
    as its address space (several blocks per row, block edges marked), and holes too small for
    the next request (external fragmentation, recorded by the contiguous allocators of
    ``fragmentation.py``) are shaded."""
    if snap.row_label == "block" and snap.kind.shape[0] > max_rows:
        snap = as_address_space(snap, -(-snap.kind.shape[0] // max_rows))
    plot_memory(snap, ax, title=title)
    per_row = snap.extra.get("blocks_per_row")
    if per_row and per_row > 1:
        bs = snap.extra["block_size"]
        for c in range(1, per_row):
            ax.axvline(c * bs - 0.5, color="white", lw=0.6)
        ax.set_xlabel(f"slot ({per_row} blocks of {bs} per row)")
    holes = snap.extra.get("external_holes") or []
    if holes:
        rows, cols = snap.kind.shape
        flat = np.zeros(rows * cols, dtype=bool)
        for start, length in holes:
            flat[start:start + length] = True
        overlay = np.zeros((rows, cols, 4))
        overlay[flat.reshape(rows, cols)] = to_rgba(WASTE_COLORS["external"], 0.85)
        ax.imshow(overlay, aspect="auto", interpolation="nearest")
        old = ax.get_legend()
        handles = list(old.legend_handles) if old else []
        handles.append(Patch(color=WASTE_COLORS["external"], label="external (hole too small)"))
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3,
                  fontsize=7, frameon=False)
    rows, cols = snap.kind.shape
    if rows <= 12:
        ax.set_yticks(range(rows))
    if cols <= 16:
        ax.set_xticks(range(cols))
    if not legend and ax.get_legend() is not None:
        ax.get_legend().remove()
    return ax


def plot_fragmentation(steps: list[int], parts: dict[str, list[int]], ax, current: int | None = None,
                       budget: int | None = None, title: str = "KV slots over time"):
    """Stacked slots per kind (token, internal, reserved, external) over steps, waste % on a
    second axis. ``parts`` maps kind -> one count per step."""
    ax.clear()
    x = np.asarray(steps)
    kinds = [k for k in ("token", "internal", "reserved", "external") if any(parts.get(k, []))]
    if len(x):
        ax.stackplot(x, *[parts[k] for k in kinds], colors=[WASTE_COLORS[k] for k in kinds],
                     labels=[WASTE_LABELS[k] for k in kinds], step="post", alpha=0.9)
    if budget:
        ax.axhline(budget, color="black", lw=0.8, ls=":", label="memory budget")
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV slots")
    ax.set_title(title, fontsize=9)
    ax2 = ax.twinx()
    tok = np.asarray(parts.get("token", []), dtype=float)
    alloc = tok + np.asarray(parts.get("internal", np.zeros_like(tok)), dtype=float) + \
        np.asarray(parts.get("reserved", np.zeros_like(tok)), dtype=float)
    waste = np.where(alloc > 0, 100 * (1 - tok / np.maximum(alloc, 1)), np.nan)
    if len(x):
        ax2.plot(x, waste, color="black", lw=1.0, drawstyle="steps-post", label="waste %")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("waste % of allocated")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=7,
              frameon=False)
    if current is not None:
        ax.axvline(current, color="black", lw=1.2)
    return ax


ABSENT, WORKING, IDLE = 0, 1, 2
TIMELINE_COLORS = {ABSENT: "#ffffff", WORKING: "#4c78a8", IDLE: "#e45756"}


def request_timeline(snapshots: list[MemorySnapshot]) -> tuple[list[str], np.ndarray]:
    """Per request and step: WORKING (its KV grew: it computed a token), IDLE (it holds KV memory
    but computed nothing: finished and waiting for the batch, or stalled) or ABSENT (holds none).
    Read from the snapshots alone, so it works for every engine."""
    ids: list[str] = []
    counts: list[dict[str, int]] = []
    for snap in snapshots:
        tok = snap.kind == TOKEN
        held = snap.owner >= 0
        c = {}
        for i, rid in enumerate(snap.owners):
            mine = snap.owner == i
            if (mine & held).any():
                c[rid] = int((mine & tok).sum())
                if rid not in ids:
                    ids.append(rid)
        counts.append(c)
    states = np.full((len(ids), len(snapshots)), ABSENT, dtype=np.int8)
    for t, c in enumerate(counts):
        for rid, n in c.items():
            before = counts[t - 1].get(rid, -1) if t else -1
            states[ids.index(rid), t] = WORKING if n > before else IDLE
    return ids, states


def plot_timeline(snapshots: list[MemorySnapshot], ax, title: str = "who holds KV memory, step by step"):
    """Requests (rows) over steps (columns): computing, holding memory idle, or not in memory."""
    ids, states = request_timeline(snapshots)
    ax.clear()
    img = np.zeros(states.shape + (3,))
    for k, color in TIMELINE_COLORS.items():
        img[states == k] = to_rgba(color)[:3]
    steps = [s.step for s in snapshots]
    if states.size:
        ax.imshow(img, aspect="auto", interpolation="nearest",
                  extent=(steps[0] - 0.5, steps[-1] + 0.5, len(ids) - 0.5, -0.5))
    ax.set_yticks(range(len(ids)), ids, fontsize=7)
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=TIMELINE_COLORS[WORKING], label="computing a token"),
                       Patch(color=TIMELINE_COLORS[IDLE], label="holding KV, idle"),
                       Patch(facecolor="white", edgecolor="#999", label="not in KV memory")],
              loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=7, frameon=False)
    return ax


# --- the live view ------------------------------------------------------------------------------
class LiveMemoryView:
    """An ``on_step`` callback that draws KV memory while the engine runs and keeps the history.

        view = LiveMemoryView(every=2)
        result = view.watch(llm, requests)       # display + run + final frame + slider
        # or: display(view); result = llm.run(requests, on_step=view); view.finish()

    ``every``: redraw every k-th step; ``min_interval_s``: but never more often than this, so
    drawing (~0.1-0.2 s a frame) never dominates a fast engine: the run's wall-clock time includes
    it, its ``StepRecord`` forward times do not. ``snapshots``/``records`` keep every step.
    """

    def __init__(self, every: int = 1, min_interval_s: float = 1.0, title: str = "",
                 figsize=(12, 3.8), dpi: int = 72, budget_slots: int | None = None):
        self.every, self.min_interval_s = max(1, every), min_interval_s
        self.title, self.figsize, self.dpi, self.budget_slots = title, figsize, dpi, budget_slots
        self.snapshots: list[MemorySnapshot] = []
        self.records: list = []
        self.breakdowns: list[dict] = []
        self.num_draws = 0
        self._last_draw = -1e9
        self._ui = None
        self._fig = None

    # called by Engine.run after every step
    def __call__(self, snapshot: MemorySnapshot, record=None) -> None:
        self.snapshots.append(snapshot)
        self.records.append(record)
        self.breakdowns.append(waste_breakdown(snapshot))
        i = len(self.snapshots) - 1
        now = time.perf_counter()
        if self._ui is not None and i % self.every == 0 and now - self._last_draw >= self.min_interval_s:
            try:
                self.show(i)
            except Exception as e:   # a drawing problem must never stop the engine
                self._ui["status"].value = f"<span style='color:#c00'>cannot draw: {e!r}</span>"
            self._last_draw = time.perf_counter()

    def finish(self) -> "LiveMemoryView":
        """Draw the last step and hand the slider to the user."""
        if self._ui is not None and self.snapshots:
            self.show(self.last_busy())
            self._ui["slider"].disabled = False
            self._ui["status"].value = (f"<b>{self.title or self.snapshots[-1].engine}</b>: "
                                        f"{len(self.snapshots)} steps recorded — drag the slider "
                                        "to scrub through the run")
        return self

    def watch(self, llm, requests, **run_kwargs):
        """Display the view, run ``llm`` (an LLM or Engine) with it as on_step, finish."""
        from IPython.display import display
        display(self)
        try:
            return llm.run(requests, on_step=self, **run_kwargs)
        finally:
            self.finish()

    def last_busy(self) -> int:
        """Index of the last step that still held KV memory (the very last one is often empty:
        everything finished and was freed)."""
        busy = [i for i, b in enumerate(self.breakdowns) if b["allocated"]]
        return busy[-1] if busy else len(self.snapshots) - 1

    # the picture
    def steps(self) -> list[int]:
        return [s.step for s in self.snapshots]

    def parts(self, upto: int | None = None) -> dict[str, list[int]]:
        b = self.breakdowns[:None if upto is None else upto + 1]
        return {k: [d[k] for d in b] for k in ("token", "internal", "reserved", "external")}

    def figure(self, i: int | None = None, fig: Figure | None = None) -> Figure:
        """Memory map at step index ``i`` (default: the last) and fragmentation up to the end."""
        i = len(self.snapshots) - 1 if i is None else i
        fig = fig or new_figure(self.figsize)
        fig.clear()
        ax_mem, ax_frag = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.15, 1]})
        if not self.snapshots:
            ax_mem.set_title("no steps yet")
            return fig
        snap = self.snapshots[i]
        draw_snapshot(snap, ax_mem)
        plot_fragmentation(self.steps(), self.parts(), ax_frag, current=snap.step,
                           budget=self.budget_slots,
                           title=f"{self.title or snap.engine}: KV slots by kind per step")
        fig.tight_layout()
        return fig

    def show(self, i: int) -> None:
        self._fig = self.figure(i, self._fig)
        ui = self._ui
        ui["image"].value = render_png(self._fig, self.dpi)
        self.num_draws += 1
        ui["slider"].unobserve(self._on_slide, names="value")
        ui["slider"].max = max(0, len(self.snapshots) - 1)
        ui["slider"].value = i
        ui["slider"].observe(self._on_slide, names="value")
        b = self.breakdowns[i]
        ui["status"].value = (f"step {self.snapshots[i].step}: {b['token']} token slots of "
                              f"{b['allocated']} allocated")

    def _on_slide(self, change) -> None:
        if self.snapshots:
            self.show(int(change["new"]))

    def widget(self):
        if self._ui is None:
            import ipywidgets as w
            ui = {"status": w.HTML(value=f"<b>{self.title}</b> waiting for the first step…"),
                  "image": w.Image(format="png"),
                  "slider": w.IntSlider(value=0, min=0, max=0, description="step index",
                                        continuous_update=False, disabled=True,
                                        layout=w.Layout(width="60%"))}
            ui["image"].add_class("minillm-live-figure")
            ui["slider"].observe(self._on_slide, names="value")
            ui["box"] = w.VBox([ui["status"], ui["image"], ui["slider"]])
            self._ui = ui
            if self.snapshots:          # displayed after a run: show the end, ready to scrub
                self.finish()
        return self._ui["box"]

    def _repr_mimebundle_(self, **kwargs):
        return self.widget()._repr_mimebundle_(**kwargs)


# --- notebook 05 --------------------------------------------------------------------------------
class FragmentationVisualizer:
    """Controls -> workload -> every allocator at one budget -> pictures and a table."""

    def __init__(self, spec: WorkloadSpec | None = None, config: SimConfig | None = None,
                 allocator: str = "paged", figsize=(12, 7.5), dpi: int = 72):
        self.spec = spec or WorkloadSpec()
        # max_len: the "model context" a max-length server reserves for every request
        self.config = config or SimConfig(max_len=512)
        self.allocator = allocator
        self.figsize, self.dpi = figsize, dpi
        self.trace: Trace | None = None
        self.results: dict[str, SimResult] = {}
        self.t = 0
        self.num_draws = 0
        self._fig = None
        self._ui = None
        self.recompute()

    # --- model ---------------------------------------------------------------------------------
    def requests(self):
        return self.trace.requests if self.trace is not None else self.spec.make()

    def sim_config(self) -> SimConfig:
        if self.trace is not None:   # the engine's limits; the pool follows the budget control
            return self.trace.config(block_size=self.config.block_size,
                                     budget_slots=self.config.budget_slots,
                                     max_len=self.config.max_len)
        return self.config

    def recompute(self) -> None:
        if self.trace is None:   # the cache only matters (and is only drawn) with shared prefixes
            self.config.enable_prefix_caching = self.spec.shared_prefix
        self.results = compare(self.requests(), self.sim_config())
        self.t = min(self.t, self.num_steps - 1) if self.num_steps else 0

    @property
    def num_steps(self) -> int:
        return max((len(r.steps) for r in self.results.values()), default=0)

    def load_trace(self, trace: Trace | str | Path) -> Trace:
        """Replay a real engine run (a ``Trace`` or the path of one saved with ``Trace.save``)."""
        if not isinstance(trace, Trace):
            if self._ui is not None:
                self._ui["trace_path"].value = str(trace)
            trace = Trace.load(trace)
        self.trace = trace
        self.config.block_size = self.trace.block_size
        self.config.budget_slots = self.trace.num_blocks * self.trace.block_size
        # the max-length reservation: the longest request of the trace, in steps of 64 slots
        longest = max((r.prompt_len + r.max_tokens for r in trace.requests), default=64)
        self.config.max_len = -(-longest // 64) * 64
        self.t = 0
        if self._ui is not None:
            self._sync_controls()
        self.recompute()
        self.redraw()
        return self.trace

    def use_synthetic(self) -> None:
        self.trace = None
        if self._ui is not None:
            self._sync_controls()
        self.recompute()
        self.redraw()

    def table_rows(self) -> list[dict]:
        rows = [r.summary() for r in self.results.values()]
        if self.trace is not None and self.trace.engine_steps:
            es = self.trace.engine_steps
            alloc = sum(s["allocated_slots"] for s in es)
            tok = sum(s["token_slots"] for s in es)
            rows.append({"allocator": f"engine run ({self.trace.source or 'recorded'})",
                         "waste_pct": 100 * (1 - tok / alloc) if alloc else 0.0,
                         "internal_pct": float("nan"), "reserved_pct": float("nan"),
                         "external_pct_of_budget": float("nan"),
                         "peak_running": max(s["num_running"] for s in es), "steps": len(es),
                         "preemptions": float("nan"), "prefix_hit_tokens": float("nan"),
                         "rejected": float("nan")})
        return rows

    def table_html(self) -> str:
        cols = [("allocator", "allocator"), ("waste_pct", "waste %"),
                ("internal_pct", "internal %"), ("reserved_pct", "reserved %"),
                ("external_pct_of_budget", "external % of pool"),
                ("peak_running", "peak concurrent requests"), ("steps", "steps to finish"),
                ("preemptions", "preemptions"), ("prefix_hit_tokens", "prefix-cache hit tokens"),
                ("rejected", "rejected")]

        def fmt(v):
            if isinstance(v, float):
                return "–" if v != v else f"{v:.1f}"
            return ALLOCATOR_LABELS.get(v, v) if isinstance(v, str) else str(v)
        head = "".join(f"<th style='padding:2px 8px'>{h}</th>" for _, h in cols)
        body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px;text-align:right'>{fmt(r[k])}</td>"
                                        for k, _ in cols) + "</tr>" for r in self.table_rows())
        cfg = self.sim_config()
        src = (f"trace <code>{self.trace.source or 'recorded'}</code> ({len(self.trace.requests)} requests)"
               if self.trace is not None else f"synthetic workload ({self.spec.num_requests} requests)")
        return (f"<div>{src}; same budget for all: {cfg.budget_slots} token slots "
                f"({cfg.num_blocks} blocks of {cfg.block_size} when paged)</div>"
                f"<table style='border-collapse:collapse;font-size:12px'><tr>{head}</tr>{body}</table>")

    # --- picture -------------------------------------------------------------------------------
    def figure(self, t: int | None = None, allocator: str | None = None,
               fig: Figure | None = None) -> Figure:
        t = self.t if t is None else t
        name = allocator or self.allocator
        fig = fig or new_figure(self.figsize)
        fig.clear()
        axes = fig.subplots(2, 2, gridspec_kw={"width_ratios": [1.1, 1]})
        res = self.results[name]
        if res.snapshots:
            k = min(t, len(res.snapshots) - 1)
            snap = res.snapshots[k]
            done = " (finished)" if t >= len(res.snapshots) else ""
            u = waste_breakdown(snap)
            draw_snapshot(snap, axes[0, 0], title=(
                f"{ALLOCATOR_LABELS[name]} — step {snap.step}{done}: {u['token']} token slots of "
                f"{u['allocated']} allocated, {res.steps[k].num_running} running, "
                f"{res.steps[k].num_waiting} waiting"))
        steps = [s.step for s in res.steps]
        parts = {k: [getattr(s, f"{k}_slots") for s in res.steps]
                 for k in ("token", "internal", "reserved", "external")}
        plot_fragmentation(steps, parts, axes[0, 1], current=t + 1, budget=res.config.budget_slots,
                           title=f"{ALLOCATOR_LABELS[name]}: KV slots by kind per step")
        for a, r in self.results.items():
            x = [s.step for s in r.steps]
            axes[1, 0].plot(x, [100 * s.waste_fraction for s in r.steps], drawstyle="steps-post",
                            color=ALLOCATOR_COLORS[a], label=ALLOCATOR_LABELS[a], lw=2 if a == name else 1)
            axes[1, 1].plot(x, [s.num_running for s in r.steps], drawstyle="steps-post",
                            color=ALLOCATOR_COLORS[a], label=ALLOCATOR_LABELS[a], lw=2 if a == name else 1)
        axes[1, 0].set_ylim(0, 100)
        axes[1, 0].set_ylabel("waste % of allocated")
        axes[1, 0].set_title("waste over time, every allocator", fontsize=9)
        axes[1, 1].set_ylabel("requests running")
        axes[1, 1].set_title(f"concurrency at the same budget ({res.config.budget_slots} slots)",
                             fontsize=9)
        for ax in axes[1]:
            ax.axvline(t + 1, color="black", lw=1.2)
            ax.set_xlabel("engine step")
            ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    def redraw(self) -> None:
        if self._ui is None:
            return
        self._fig = self.figure(fig=self._fig)
        self._ui["image"].value = render_png(self._fig, self.dpi)
        self._ui["table"].value = self.table_html()
        self.num_draws += 1

    # --- controls ------------------------------------------------------------------------------
    def widget(self):
        if self._ui is not None:
            return self._ui["box"]
        import ipywidgets as w
        s, c = self.spec, self.config
        style = {"description_width": "130px"}
        lay = w.Layout(width="380px")
        ui = {
            "allocator": w.Dropdown(options=[(ALLOCATOR_LABELS[a], a) for a in ALLOCATORS],
                                    value=self.allocator, description="allocator", style=style, layout=lay),
            "block_size": w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64], value=c.block_size,
                                            description="block size", style=style, layout=lay,
                                            continuous_update=False),
            "budget": w.IntSlider(value=c.budget_slots, min=64, max=16384, step=16,
                                  description="budget (slots)", style=style, layout=lay,
                                  continuous_update=False),
            "max_len": w.IntSlider(value=c.max_len or 512, min=64, max=4096, step=64,
                                   description="max-length reserve", style=style, layout=lay,
                                   continuous_update=False),
            "num_requests": w.IntSlider(value=s.num_requests, min=1, max=128, description="requests",
                                        style=style, layout=lay, continuous_update=False),
            "rate": w.FloatSlider(value=s.arrival_rate or 0.0, min=0.0, max=4.0, step=0.1,
                                  description="arrivals / step", style=style, layout=lay,
                                  continuous_update=False),
            "prompt": w.IntRangeSlider(value=s.prompt_len, min=1, max=1024, description="prompt len",
                                       style=style, layout=lay, continuous_update=False),
            "output": w.IntRangeSlider(value=s.output_len, min=1, max=1024, description="output len",
                                       style=style, layout=lay, continuous_update=False),
            "dist": w.Dropdown(options=LENGTH_DISTS, value=s.length_dist, description="length dist",
                               style=style, layout=lay),
            "prefix": w.Checkbox(value=s.shared_prefix, description="shared prefix (prefix caching)",
                                 indent=False),
            "n": w.IntSlider(value=s.n, min=1, max=4, description="parallel samples n", style=style,
                             layout=lay, continuous_update=False),
            "time": w.IntSlider(value=self.t, min=0, max=max(0, self.num_steps - 1),
                                description="time (step)", style=style,
                                layout=w.Layout(width="760px"), continuous_update=True),
            "trace_path": w.Text(value="", placeholder="path of a trace .json (Trace.save)",
                                 description="trace", style=style, layout=lay),
            "load": w.Button(description="load trace", icon="upload"),
            "synthetic": w.Button(description="synthetic workload"),
            "status": w.HTML(),
            "table": w.HTML(),
            "image": w.Image(format="png"),
        }
        ui["play"] = w.Play(value=0, min=0, max=ui["time"].max, step=1, interval=150)
        w.jslink((ui["play"], "value"), (ui["time"], "value"))
        ui["image"].add_class("minillm-viz-figure")
        ui["allocator"].add_class("minillm-viz-allocator")
        self._ui = ui
        for key in ("block_size", "budget", "max_len", "num_requests", "rate", "prompt", "output",
                    "dist", "prefix", "n"):
            ui[key].observe(self._on_workload, names="value")
        ui["allocator"].observe(self._on_allocator, names="value")
        ui["time"].observe(self._on_time, names="value")
        ui["load"].on_click(self._on_load)
        ui["synthetic"].on_click(lambda _: self.use_synthetic())
        left = w.VBox([ui[k] for k in ("allocator", "block_size", "budget", "max_len", "num_requests")])
        right = w.VBox([ui[k] for k in ("rate", "prompt", "output", "dist", "n", "prefix")])
        trace_row = w.HBox([ui["trace_path"], ui["load"], ui["synthetic"]])
        ui["box"] = w.VBox([w.HBox([left, right]), trace_row, ui["status"],
                            w.HBox([ui["play"], ui["time"]]), ui["image"], ui["table"]])
        self._sync_controls()
        self.redraw()
        return ui["box"]

    def _repr_mimebundle_(self, **kwargs):
        return self.widget()._repr_mimebundle_(**kwargs)

    def _sync_controls(self) -> None:
        ui = self._ui
        synthetic = self.trace is None
        for k in ("num_requests", "rate", "prompt", "output", "dist", "prefix", "n"):
            ui[k].disabled = not synthetic
        for key, value in (("block_size", self.config.block_size),
                           ("budget", self.config.budget_slots), ("max_len", self.config.max_len)):
            ui[key].unobserve(self._on_workload, names="value")
            if key == "block_size":
                ui[key].value = value
            else:
                ui[key].value = max(ui[key].min, min(ui[key].max, value or ui[key].min))
            ui[key].observe(self._on_workload, names="value")
        self._update_time_range()
        ui["status"].value = ("replaying a recorded engine trace: workload controls are fixed; "
                              "block size and budget still apply"
                              if not synthetic else "synthetic workload: every control re-runs "
                              "all three allocators")

    def _update_time_range(self) -> None:
        ui = self._ui
        top = max(0, self.num_steps - 1)
        ui["time"].unobserve(self._on_time, names="value")
        ui["time"].max = top
        ui["play"].max = top
        ui["time"].value = min(self.t, top)
        ui["time"].observe(self._on_time, names="value")

    def _on_workload(self, _change=None) -> None:
        ui = self._ui
        s, c = self.spec, self.config
        c.block_size = int(ui["block_size"].value)
        c.budget_slots = int(ui["budget"].value)
        c.max_len = int(ui["max_len"].value)
        s.num_requests = int(ui["num_requests"].value)
        s.arrival_rate = float(ui["rate"].value) or None
        s.prompt_len = tuple(ui["prompt"].value)
        s.output_len = tuple(ui["output"].value)
        s.length_dist = ui["dist"].value
        s.shared_prefix = bool(ui["prefix"].value)
        s.n = int(ui["n"].value)
        try:
            self.recompute()
        except Exception as e:     # a bad combination must not kill the widget
            ui["status"].value = f"<span style='color:#c00'>{type(e).__name__}: {e}</span>"
            return
        self._update_time_range()
        self.redraw()

    def _on_allocator(self, change) -> None:
        self.allocator = change["new"]
        self.redraw()

    def _on_time(self, change) -> None:
        self.t = int(change["new"])
        self.redraw()

    def _on_load(self, _button=None) -> None:
        path = self._ui["trace_path"].value.strip()
        try:
            self.load_trace(path)
        except Exception as e:
            self._ui["status"].value = f"<span style='color:#c00'>could not load {path!r}: {e}</span>"


def compare_figure(results: dict[str, SimResult], t: int, fig: Figure | None = None) -> Figure:
    """Every allocator's memory at step index ``t`` side by side (same budget), then waste %,
    requests running and tokens held over time."""
    fig = fig or new_figure((15, 8))
    fig.clear()
    names = list(results)
    axes = fig.subplots(2, len(names))
    for ax, name in zip(axes[0], names):
        res = results[name]
        if not res.snapshots:
            continue
        k = min(t, len(res.snapshots) - 1)
        snap = res.snapshots[k]
        u = waste_breakdown(snap)
        draw_snapshot(snap, ax, legend=False, title=(f"{ALLOCATOR_LABELS[name]}, step {snap.step}\n"
                                       f"{res.steps[k].num_running} running, "
                                       f"{res.steps[k].num_waiting} waiting, "
                                       f"{100 * (1 - u['token'] / u['allocated']) if u['allocated'] else 0:.0f}% "
                                       f"of allocated wasted"))
    series = [("waste % of allocated", lambda s: 100 * s.waste_fraction),
              ("requests running", lambda s: s.num_running),
              ("KV slots holding tokens", lambda s: s.token_slots)]
    for ax, (label, f) in zip(axes[1], series):
        for name, res in results.items():
            ax.plot([s.step for s in res.steps], [f(s) for s in res.steps], drawstyle="steps-post",
                    color=ALLOCATOR_COLORS[name], label=ALLOCATOR_LABELS[name])
        ax.axvline(t + 1, color="black", lw=1)
        ax.set_xlabel("engine step")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    budget = next(iter(results.values())).config.budget_slots
    fig.legend(handles=memory_legend_handles(), loc="lower center", bbox_to_anchor=(0.5, 0.0),
               ncol=6, fontsize=8, frameon=False, title="memory maps (top row)",
               title_fontsize=8)
    fig.suptitle(f"The same workload, the same KV budget ({budget} token slots), three allocators",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
