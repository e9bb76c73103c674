"""``FragmentationVisualizer``, the ipywidget of notebook 05 (``05_fragmentation_visualizer``).

Controls for a workload (``minillm/workload.py``) and the allocators (``minillm/engines/r5_allocators/``), a time slider,
a table of waste per allocator at the same budget, and loading of a trace recorded from a real
engine run (``traces.py``). Every control re-runs all the allocators (``replay.compare``).
No drawing here: the picture is ``notebook_figures.allocator_figure``, rendered into PNG bytes
shown by an ``ipywidgets.Image``; drawing frames without a backlog while ▶ plays is
``frames.FramePlayer``'s job.
"""
from __future__ import annotations

import base64
from pathlib import Path

from matplotlib.figure import Figure

from ..memory import waste_fraction
from ..engines.r5_allocators import ALLOCATORS
from .accounting import ALLOCATOR_LABELS, SimConfig, SimResult
from .replay import compare
from .frames import PLAY_MIN_INTERVAL_MS, FramePlayer
from .notebook import scratch_dir, static_export  # noqa: F401  (scratch_dir: notebook 05)
from .notebook_figures import allocator_figure
from .plots import new_figure, render_png
from .traces import Trace
from ..workload import LENGTH_DISTS, WorkloadSpec

TABLE_COLUMNS = [("allocator", "allocator"), ("waste_pct", "waste %"),
                 ("internal_pct", "internal %"), ("reserved_pct", "reserved %"),
                 ("external_pct_of_budget", "external % of pool"),
                 ("peak_running", "peak concurrent requests"), ("steps", "steps to finish"),
                 ("preemptions", "preemptions"), ("prefix_hit_tokens", "prefix-cache hit tokens"),
                 ("rejected", "rejected")]


class FragmentationVisualizer(FramePlayer):
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
        self.t, self.trace_path = 0, ""      # trace_path: what load_trace read (the trace box)
        self._ui = None
        self.init_frames()
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
        self.forget_frames()
        self.t = min(self.t, self.num_steps - 1) if self.num_steps else 0

    @property
    def num_steps(self) -> int:
        return max((len(r.steps) for r in self.results.values()), default=0)

    def load_trace(self, trace: Trace | str | Path) -> Trace:
        """Replay a real engine run (a ``Trace`` or the path of one saved with ``Trace.save``)."""
        if not isinstance(trace, Trace):
            self.trace_path = str(trace)
            if self._ui is not None:
                self._ui["trace_path"].value = self.trace_path
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
            waste = waste_fraction(sum(s["token"] for s in es), sum(s["allocated"] for s in es))
            rows.append({k: float("nan") for k, _ in TABLE_COLUMNS} | {
                "allocator": f"engine run ({self.trace.source or 'recorded'})",
                "waste_pct": 100 * waste, "peak_running": max(s["num_running"] for s in es),
                "steps": len(es)})
        return rows

    def table_html(self) -> str:
        def fmt(v):
            if isinstance(v, float):
                return "–" if v != v else f"{v:.1f}"
            return ALLOCATOR_LABELS.get(v, v) if isinstance(v, str) else str(v)
        head = "".join(f"<th style='padding:2px 8px'>{h}</th>" for _, h in TABLE_COLUMNS)
        body = "".join("<tr>" + "".join(f"<td style='padding:2px 8px;text-align:right'>{fmt(r[k])}</td>"
                                        for k, _ in TABLE_COLUMNS) + "</tr>" for r in self.table_rows())
        cfg = self.sim_config()
        src = (f"trace <code>{self.trace.source or 'recorded'}</code> ({len(self.trace.requests)} requests)"
               if self.trace is not None else f"synthetic workload ({self.spec.num_requests} requests)")
        return (f"<div>{src}; same budget for all: {cfg.budget_slots} token slots "
                f"({cfg.num_blocks} blocks of {cfg.block_size} when paged)</div>"
                f"<table style='border-collapse:collapse;font-size:12px'><tr>{head}</tr>{body}</table>")

    # --- picture -------------------------------------------------------------------------------
    def figure(self, t: int | None = None, allocator: str | None = None,
               fig: Figure | None = None) -> Figure:
        return allocator_figure(self.results, allocator or self.allocator,
                                self.t if t is None else t, fig or new_figure(self.figsize))

    def draw_frame(self, results, allocator: str, t: int, fig: Figure) -> None:
        allocator_figure(results, allocator, t, fig)

    # --- controls ------------------------------------------------------------------------------
    def widget(self):
        if self._ui is not None:
            return self._ui["box"]
        import ipywidgets as w
        s, c = self.spec, self.config
        kw = dict(style={"description_width": "130px"}, layout=w.Layout(width="380px"))
        rel = dict(kw, continuous_update=False)

        def slider(cls, description, value, lo, hi, **more):   # reports when released
            return cls(value=value, min=lo, max=hi, description=description, **rel, **more)
        ui = {
            "allocator": w.Dropdown(options=[(ALLOCATOR_LABELS[a], a) for a in ALLOCATORS],
                                    value=self.allocator, description="allocator", **kw),
            "block_size": w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64], value=c.block_size,
                                            description="block size", **rel),
            "budget": slider(w.IntSlider, "budget (slots)", c.budget_slots, 64, 16384, step=16),
            "max_len": slider(w.IntSlider, "max-length reserve", c.max_len or 512, 64, 4096, step=64),
            "num_requests": slider(w.IntSlider, "requests", s.num_requests, 1, 128),
            "rate": slider(w.FloatSlider, "arrivals / step", s.arrival_rate or 0.0, 0.0, 4.0, step=0.1),
            "prompt": slider(w.IntRangeSlider, "prompt len", s.prompt_len, 1, 1024),
            "output": slider(w.IntRangeSlider, "output len", s.output_len, 1, 1024),
            "dist": w.Dropdown(options=LENGTH_DISTS, value=s.length_dist, description="length dist",
                               **kw),
            "prefix": w.Checkbox(value=s.shared_prefix, description="shared prefix (prefix caching)",
                                 indent=False),
            "n": slider(w.IntSlider, "parallel samples n", s.n, 1, 4),
            "time": w.IntSlider(value=self.t, min=0, max=max(0, self.num_steps - 1),
                                description="time (step)", style=kw["style"],
                                layout=w.Layout(width="760px")),
            "trace_path": w.Text(value=self.trace_path, description="trace", **kw,
                                 placeholder="path of a trace .json (Trace.save)"),
            "load": w.Button(description="load trace", icon="upload"),
            "synthetic": w.Button(description="synthetic workload"),
            "status": w.HTML(), "table": w.HTML(), "image": w.Image(format="png"),
        }
        ui["play"] = w.Play(value=self.t, min=0, max=ui["time"].max, interval=PLAY_MIN_INTERVAL_MS)
        w.jslink((ui["play"], "value"), (ui["time"], "value"))
        for key in ("play", "time", "allocator"):
            ui[key].add_class(f"minillm-viz-{key}")
        ui["image"].add_class("minillm-viz-figure")
        self._ui = ui
        for key in ("block_size", "budget", "max_len", "num_requests", "rate", "prompt", "output",
                    "dist", "prefix", "n"):
            ui[key].observe(self._on_workload, names="value")
        ui["allocator"].observe(self._on_allocator, names="value")
        ui["time"].observe(self._on_time, names="value")
        ui["play"].observe(self._on_playing, names="playing")
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
        bundle = self.widget()._repr_mimebundle_(**kwargs)
        if static_export():       # an exported copy shows the picture (widgets need a kernel)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            data["image/png"] = base64.b64encode(render_png(self.figure(), self.dpi)).decode()
        return bundle

    def _sync_controls(self) -> None:
        ui = self._ui
        synthetic = self.trace is None
        for k in ("num_requests", "rate", "prompt", "output", "dist", "prefix", "n"):
            ui[k].disabled = not synthetic
        for key, value in (("block_size", self.config.block_size),
                           ("budget", self.config.budget_slots), ("max_len", self.config.max_len)):
            ui[key].unobserve(self._on_workload, names="value")
            ui[key].value = (value if key == "block_size"
                             else max(ui[key].min, min(ui[key].max, value or ui[key].min)))
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
        ui["time"].max = ui["play"].max = top
        ui["time"].value = min(self.t, top)
        ui["time"].observe(self._on_time, names="value")

    def _on_workload(self, _change=None) -> None:
        ui = self._ui
        s, c = self.spec, self.config
        c.block_size, c.budget_slots, c.max_len = (int(ui[k].value)
                                                   for k in ("block_size", "budget", "max_len"))
        s.num_requests, s.n = int(ui["num_requests"].value), int(ui["n"].value)
        s.arrival_rate = float(ui["rate"].value) or None
        s.prompt_len, s.output_len = tuple(ui["prompt"].value), tuple(ui["output"].value)
        s.length_dist, s.shared_prefix = ui["dist"].value, bool(ui["prefix"].value)
        try:
            self.recompute()
        except Exception as e:     # a bad combination must not kill the widget
            ui["status"].value = f"<span style='color:#c00'>{type(e).__name__}: {e}</span>"
            return
        self._update_time_range()
        self.request_redraw()

    def _on_allocator(self, change) -> None:
        self.allocator = change["new"]
        self.request_redraw()

    def _on_time(self, change) -> None:
        self.t = int(change["new"])
        self.request_redraw()

    def _on_load(self, _button=None) -> None:
        path = self._ui["trace_path"].value.strip()
        try:
            self.load_trace(path)
        except Exception as e:
            self._ui["status"].value = f"<span style='color:#c00'>could not load {path!r}: {e}</span>"
