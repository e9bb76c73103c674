"""Frames without a backlog: how the fragmentation visualizer draws while ▶ plays (notebook 05).

A frame takes ~0.1-1 s to draw, so a widget change only records the wanted step (``self.t``) and
schedules one draw on the kernel's event loop; it renders in a worker thread (the kernel keeps
reading messages meanwhile) and always the newest wanted step: N pending changes cost one or two
renders. Recent frames are kept (``FRAME_CACHE``). ▶'s interval follows the render time
(``play_interval_ms``); after ■ no frame of the backlog is shown, only the step the slider rests on.
``viz.t = 5; viz.redraw()`` and ``viz.figure(t)`` draw at once, as does any change made while no
event loop runs.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict

from matplotlib.figure import Figure

from .plots import new_figure, render_png

PLAY_MIN_INTERVAL_MS = 150    # ▶'s fastest pace
PLAY_HEADROOM = 1.3           # ▶'s interval: at least this many times the last frame's draw time
STOP_SETTLE_S = 0.05          # after ■, a pending draw waits this long for ■'s reset of the slider
FRAME_CACHE = 64              # recent frames kept as PNG (~70 kB each): scrubbing back is instant


class FramePlayer:
    """Mixin for a widget that shows one PNG frame per step. The host provides ``_ui`` (with
    ``image``, ``table``, ``play``, ``status``), ``results``, ``figsize``, ``dpi``, ``t``,
    ``allocator``, ``table_html()`` and ``draw_frame(results, allocator, t, fig)``."""

    def init_frames(self) -> None:
        self.draw_count, self.drawn_t = 0, None   # frames shown in the widget; the step shown
        self.render_count, self.last_draw_s, self._clock = 0, 0.0, time.perf_counter
        self._gen, self._frames = 0, OrderedDict()   # results' generation; recent PNGs by _key()
        self._pending, self._busy, self._epoch = None, False, 0   # scheduled draw; frame in flight
        self._shown = self._fig = None
        self._draw_lock = threading.Lock()

    def forget_frames(self) -> None:
        """The results changed: every kept frame is stale."""
        self._gen += 1
        self._frames.clear()

    def redraw(self) -> None:
        """Draw step ``self.t`` into the widget now, in this thread (nothing without a widget)."""
        if self._ui is not None:
            key = self._key()
            if key not in self._frames:
                self._fig = self._fig or new_figure(self.figsize)
                self._done(key, self._render(self.results, key, self._fig))
            self._show(key)

    def request_redraw(self, delay_s: float = 0.0) -> None:
        """Draw step ``self.t`` soon, off the event loop: one draw however many requests come
        first, always of the newest step. Without a running event loop, draw at once."""
        if self._ui is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.redraw()
            return
        if self._pending is None and not self._busy:   # when busy, _frame_done asks again
            self._pending = (loop.call_later(delay_s, self._flush) if delay_s > 0
                             else loop.call_soon(self._flush))

    def play_interval_ms(self) -> int:
        """▶'s interval: never faster than a frame can be drawn."""
        return max(PLAY_MIN_INTERVAL_MS, math.ceil(PLAY_HEADROOM * self.last_draw_s * 1000))

    def _key(self) -> tuple:        # what a frame shows
        return self._gen, self.allocator, self.t

    def _render(self, results, key, fig: Figure) -> tuple[bytes, float]:   # in any thread
        with self._draw_lock:                      # one matplotlib drawing at a time
            start = self._clock()
            self.draw_frame(results, key[1], key[2], fig)
            return render_png(fig, self.dpi), self._clock() - start

    def _done(self, key, out: tuple[bytes, float]) -> None:
        """A frame was rendered: keep it, and pace ▶ to how long it took."""
        png, self.last_draw_s = out
        self.render_count += 1
        if key[0] == self._gen:
            self._frames[key] = png
            while len(self._frames) > FRAME_CACHE:
                self._frames.popitem(last=False)
        play, want = self._ui["play"], self.play_interval_ms()
        # slow down at once; speed up only for a clear gain (each change is a message to the browser)
        if want > play.interval or want < 0.8 * play.interval:
            play.interval = want

    def _show(self, key) -> None:
        self._frames.move_to_end(key)
        self._ui["image"].value = self._frames[key]
        self._ui["table"].value = self.table_html()
        self._shown, self.drawn_t = key, key[2]
        self.draw_count += 1

    def _flush(self) -> None:
        self._pending = None
        key = self._key()
        if key == self._shown:
            return
        if key in self._frames:
            return self._show(key)
        self._busy, loop, epoch, results = True, asyncio.get_running_loop(), self._epoch, self.results
        fig = self._fig = self._fig or new_figure(self.figsize)   # _render draws one at a time

        def work():
            try:
                out = self._render(results, key, fig)
            except Exception as e:                 # reported by _frame_done
                out = e
            try:
                loop.call_soon_threadsafe(self._frame_done, key, epoch, out)
            except RuntimeError:                   # the event loop is gone
                self._busy = False
        threading.Thread(target=work, name="minillm-viz-frame", daemon=True).start()

    def _frame_done(self, key, epoch: int, out) -> None:
        self._busy = False
        if isinstance(out, Exception):
            self._ui["status"].value = f"<span style='color:#c00'>cannot draw: {out!r}</span>"
            return
        self._done(key, out)
        newest = self._key()
        # the wanted step, or one on the way to it; never a frame that a ■ since has made stale
        if key[0] == self._gen and (key == newest or (epoch == self._epoch and key[1] == newest[1])):
            self._show(key)
        if newest != self._shown:
            self.request_redraw()

    def _on_playing(self, change) -> None:
        # ■/pause: the frame in flight is shown only if it is the step the slider rests on, and a
        # pending draw waits a moment for ■'s reset of the slider to its minimum: no backlog
        if not change["new"]:
            self._epoch += 1
        if not change["new"] and self._pending is not None:
            self._pending.cancel()
            self._pending = None
            self.request_redraw(STOP_SETTLE_S)
