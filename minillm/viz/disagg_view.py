"""``TwoPoolView``: the live KV view of the disagg engine, its two pools side by side (notebook 11).

The decode worker's pool is this process's (the snapshot every step hands ``on_step``); the
prefill worker's lives in the other process, so the view asks the engine for its latest picture
(``DisaggEngine.prefill_snapshot``: it travels with the worker's next reply). A request's blocks
appear on the right while its prompt is computed and waits to be pulled, then on the left once
they have moved. The view is rung 5's ``LiveMemoryView`` (an ``on_step`` callback, the slider)
with the fragmentation panel replaced by the other pool and a strip of blocks used on each side.
"""
from __future__ import annotations

from matplotlib.figure import Figure

from ..memory import MemorySnapshot
from .live_view import LiveMemoryView
from .plots import draw_snapshot, new_figure


class TwoPoolView(LiveMemoryView):
    """``LiveMemoryView`` of a ``DisaggEngine``: ``view.watch(engine, requests)``."""

    def __init__(self, engine, **kwargs):
        if not engine.has_prefill_pool:
            raise TypeError(f"TwoPoolView watches the disagg engine (one with a prefill worker), "
                            f"not {type(engine).__name__}")
        kwargs.setdefault("figsize", (12, 4.2))
        super().__init__(**kwargs)
        self.engine = engine
        self.prefill: list[MemorySnapshot | None] = []     # the prefill pool, at each step

    def __call__(self, snapshot: MemorySnapshot, record=None) -> None:
        self.prefill.append(self.engine.prefill_snapshot())
        super().__call__(snapshot, record)

    def used_blocks(self) -> tuple[list[int], list[int]]:
        """Blocks held at each step: (decode pool, prefill pool as last pictured)."""
        def held(s):
            return 0 if s is None else (s.counts.allocated // max(1, s.kind.shape[1]))
        return [held(s) for s in self.snapshots], [held(s) for s in self.prefill]

    def figure(self, i: int | None = None, fig: Figure | None = None) -> Figure:
        i = len(self.snapshots) - 1 if i is None else i
        fig = fig or new_figure(self.figsize)
        fig.clear()
        grid = fig.add_gridspec(2, 2, height_ratios=[3, 1.1])
        ax_dec, ax_pre = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
        ax_use = fig.add_subplot(grid[1, :])
        if not self.snapshots:
            ax_dec.set_title("no steps yet")
            return fig
        step = self.snapshots[i].step
        draw_snapshot(self.snapshots[i], ax_dec)
        ax_dec.set_title(f"decode worker (rank 0), step {step}", fontsize="medium")
        if self.prefill[i] is not None:
            draw_snapshot(self.prefill[i], ax_pre)
        ax_pre.set_title("prefill worker (rank 1), its latest reply", fontsize="medium")
        dec, pre = self.used_blocks()
        steps = self.steps()
        ax_use.plot(steps, dec, label="decode pool", color="tab:blue")
        ax_use.plot(steps, pre, label="prefill pool", color="tab:orange")
        ax_use.axvline(step, color="0.5", lw=0.8)
        ax_use.set_xlabel("step (rank 0)")
        ax_use.set_ylabel("blocks held")
        ax_use.legend(loc="upper right", fontsize="small")
        fig.tight_layout()
        return fig
