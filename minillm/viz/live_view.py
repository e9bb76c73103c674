"""``LiveMemoryView``, the ipywidget of every notebook (00-05): KV memory while an engine runs.

It is an ``on_step`` callback: ``llm.run(requests, on_step=view)``. Every ``every`` steps (and at
most once per ``min_interval_s``) it redraws the KV memory map next to fragmentation over time,
and it keeps every snapshot (the notebook figures of ``notebook_figures.py`` read them), so after
the run its slider scrubs back to any step. No drawing here: the picture is ``plots.live_figure``,
rendered with matplotlib's Agg canvas into PNG bytes shown by an ``ipywidgets.Image``. Updating
an image widget's value is all it takes, live in JupyterLab while a cell runs, headless under
nbclient, and in a browser alike; ``figure()`` returns the picture as a ``Figure`` to save.

A widget needs a live kernel: a page converted from the executed notebook (``jupyter nbconvert``,
``python -m minillm.lab export``) has none, so ``finish`` also leaves the last frame in the output
as a plain picture (``StaticFigure``), which hides itself wherever the live widget is drawn.
"""
from __future__ import annotations

import base64
import time
from html import escape as html_escape

from matplotlib.figure import Figure

from ..memory import KVCounts, MemorySnapshot
from .notebook import quick_mode
from .plots import live_figure, render_png

LIVE_CLASS = "minillm-live-figure"          # the live widget's image element
STATIC_CLASS = "minillm-static-figure"      # its picture for pages without a kernel
# The static picture steps aside in an output area (JupyterLab's, nbconvert's lab template,
# classic Notebook's) that also holds a drawn live widget; anywhere else it shows.
HIDE_WHEN_LIVE = ", ".join(f"{area}:has(.{LIVE_CLASS}) .{STATIC_CLASS}"
                           for area in (".jp-OutputArea", ".output")) + " { display: none; }"


class StaticFigure:
    """A PNG for pages that cannot run widgets, as HTML that hides itself beside a live widget
    (and as ``image/png`` for front ends that show no HTML)."""

    def __init__(self, png: bytes, alt: str = ""):
        self.png, self.alt = png, alt

    def _repr_mimebundle_(self, **kwargs) -> dict:
        data = base64.b64encode(self.png).decode()
        html = (f"<style>{HIDE_WHEN_LIVE}</style><img class=\"{STATIC_CLASS}\" "
                f"alt=\"{html_escape(self.alt)}\" src=\"data:image/png;base64,{data}\">")
        return {"text/html": html, "image/png": data, "text/plain": f"<{self.alt}>"}

    def __repr__(self) -> str:
        return f"<{self.alt}>"


class LiveMemoryView:
    """An ``on_step`` callback that draws KV memory while the engine runs and keeps the history.

        view = LiveMemoryView(every=2)
        result = view.watch(llm, requests)       # display + run + final frame + slider
        # or: display(view); result = llm.run(requests, on_step=view); view.finish()

    ``every``: redraw every k-th step; ``min_interval_s``: but never more often than this, so
    drawing (~0.1-0.3 s a frame) never dominates a fast engine: the run's wall-clock time includes
    it, its ``StepRecord`` forward times do not. ``snapshots``/``records`` keep every step. In
    quick mode (``MINILLM_QUICK=1``: the tests, CI) only the final frame is drawn: the frames in
    between are the same drawing of earlier steps, and they were a third of a quick notebook's
    run (notebook 08's policies: ~6 s of 25).
    """

    def __init__(self, every: int = 1, min_interval_s: float = 1.0, title: str = "",
                 figsize=(12, 3.8), dpi: int = 72, budget_slots: int | None = None):
        self.every, self.min_interval_s = max(1, every), min_interval_s
        self.title, self.figsize, self.dpi, self.budget_slots = title, figsize, dpi, budget_slots
        self.snapshots: list[MemorySnapshot] = []
        self.records: list = []
        self.counts: list[KVCounts] = []
        self._last_draw = -1e9
        self.draws_while_running = not quick_mode()
        self._ui = None
        self._fig = None
        self._png: tuple = (None, b"")        # (frame key, PNG bytes) of the last frame rendered

    # called by Engine.run after every step
    def __call__(self, snapshot: MemorySnapshot, record=None) -> None:
        self.snapshots.append(snapshot)
        self.records.append(record)
        self.counts.append(snapshot.counts)
        i = len(self.snapshots) - 1
        now = time.perf_counter()
        if (self._ui is not None and self.draws_while_running and i % self.every == 0
                and now - self._last_draw >= self.min_interval_s):
            try:
                self.show(i)
            except Exception as e:   # a drawing problem must never stop the engine
                self._ui["status"].value = f"<span style='color:#c00'>cannot draw: {e!r}</span>"
            self._last_draw = time.perf_counter()

    def finish(self) -> "LiveMemoryView":
        """Draw the last step and hand the slider to the user; leave that picture in the output
        too, for a page without a kernel (``StaticFigure``: hidden beside the live widget)."""
        if self.snapshots:
            from IPython.display import display
            display(self.static_figure())
        return self._finish_widget()

    def static_figure(self) -> StaticFigure:
        """The last busy step's picture, for pages that cannot run the widget."""
        i = self.last_busy()
        name = self.title or self.snapshots[i].engine
        return StaticFigure(self.render(i), f"{name}: KV memory at step {self.snapshots[i].step}")

    def render(self, i: int) -> bytes:
        """Frame ``i`` as PNG. The last one is kept: ``finish`` shows the same frame twice (the
        static picture and the widget), and a frame depends on every snapshot so far."""
        key = (i, len(self.snapshots))
        if self._png[0] != key:
            self._fig = self.figure(i, self._fig)
            self._png = (key, render_png(self._fig, self.dpi))
        return self._png[1]

    def _finish_widget(self) -> "LiveMemoryView":
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
        busy = [i for i, c in enumerate(self.counts) if c.allocated]
        return busy[-1] if busy else len(self.snapshots) - 1

    # the picture
    def steps(self) -> list[int]:
        return [s.step for s in self.snapshots]

    def figure(self, i: int | None = None, fig: Figure | None = None) -> Figure:
        """Memory map at step index ``i`` (default: the last) and fragmentation up to the end."""
        return live_figure(self.snapshots, self.counts, i, fig, self.figsize, self.budget_slots,
                           self.title)

    def show(self, i: int) -> None:
        ui = self._ui
        ui["image"].value = self.render(i)
        ui["slider"].unobserve(self._on_slide, names="value")
        ui["slider"].max = max(0, len(self.snapshots) - 1)
        ui["slider"].value = i
        ui["slider"].observe(self._on_slide, names="value")
        c = self.counts[i]
        ui["status"].value = (f"step {self.snapshots[i].step}: {c.token} token slots of "
                              f"{c.allocated} allocated")

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
            ui["image"].add_class(LIVE_CLASS)
            ui["slider"].observe(self._on_slide, names="value")
            ui["box"] = w.VBox([ui["status"], ui["image"], ui["slider"]])
            self._ui = ui
            if self.snapshots:          # displayed after a run: show the end, ready to scrub
                self._finish_widget()
        return self._ui["box"]

    def _repr_mimebundle_(self, **kwargs):
        return self.widget()._repr_mimebundle_(**kwargs)
