"""The live dashboard: ``/dashboard`` (a page) fed by ``/dashboard/events`` (server-sent events).

What it shows is what notebook 02 (continuous batching) and notebook 03 (the block manager) draw
offline, now with real clients: the running batch, one row per request growing token by token; the
waiting queue; the KV block pool; TTFT and TPOT of each finished request over time. The pool is the
engine's own ``MemorySnapshot`` (``minillm/memory.py``, the picture every notebook draws) turned
into JSON: nothing here recomputes what the engine already reports.

Frames are built on the engine loop thread right after a step (the only moment the engine's state
is consistent), at most ``FRAME_INTERVAL_S`` apart and only while someone watches, from the
record the loop builds for each (``EngineLoop.refresh_stats(detail=True)``: an ``EngineStats``
with the pool's picture and the requests in flight, ``runtime/stats.py``): nothing here reads the
engine itself. The SSE handlers just send the newest frame. A page that connects first gets a
frame built after it came (never an older one: the engine may have run for hours since nobody
watched). The header's counts are the lengths of the lists the page shows: the waiting list holds
every request not yet running, those the engine loop has accepted but not yet handed to the
engine included.

A frame holds the newest tokens of every request as text: with ``serve --api-key`` only key
holders get the page and its events (``guard.RequireKey``); without a key, anyone who can reach
the server sees everyone's outputs (the default host, 127.0.0.1, is this machine only).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from pathlib import Path

import numpy as np
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse

from ..memory import MemorySnapshot
from ..runtime.stats import EngineDetail, RequestStats
from .loop import EngineLoop

PAGE = Path(__file__).parent / "static" / "dashboard.html"
CONTROLLER_KEYS = ("batch_cap", "tpot_target_ms", "tpot_overload", "arrivals_per_s", "load")
FRAME_INTERVAL_S = 0.1
MAX_CELLS = 1 << 16        # a bigger pool is drawn up to its first MAX_CELLS slots
MAX_STREAM_S = 600         # an SSE stream ends after this (the browser reconnects by itself)
TAIL_TOKENS = 24           # the text shown for each running request: its newest tokens


class Dashboard:
    def __init__(self, loop: EngineLoop, tokenizer):
        self.loop, self.tokenizer = loop, tokenizer
        self.t0 = time.perf_counter()
        self.frame: dict = {}
        self.version = 0
        self.watchers = 0
        self.last_build = 0.0
        self.points: deque = deque(maxlen=500)   # (finish time, ttft ms, tpot ms, priority)
        self.tokens: deque = deque(maxlen=64)    # (time, generation tokens so far) for tok/s
        self.num_finished = 0
        loop.on_step.append(self.on_step)

    def on_step(self, loop: EngineLoop, out) -> None:
        now = time.perf_counter()
        for req in out.finished:
            self.num_finished += 1
            if req.first_token_time is not None and req.arrival_time is not None:
                ttft = req.first_token_time - req.arrival_time
                n = max(len(s) for s in req.samples) if req.samples else len(req.output_token_ids)
                tpot = (req.finish_time - req.first_token_time) / (n - 1) if n > 1 else None
                self.points.append((round(now - self.t0, 3), round(ttft * 1e3, 2),
                                    None if tpot is None else round(tpot * 1e3, 2),
                                    req.priority))
        idle = not loop.stats.has_unfinished      # the record the loop built after this step
        if self.watchers and (idle or now - self.last_build >= FRAME_INTERVAL_S):
            self.build(now)

    def build(self, now: float) -> None:
        """The frame after the latest step (loop thread only, or before the loop starts), from a
        detailed record the loop builds for it."""
        loop = self.loop
        stats = loop.refresh_stats(detail=True)
        view = stats.detail
        self.tokens.append((now, loop.metrics.generation_tokens))
        (t_a, n_a), (t_b, n_b) = self.tokens[0], self.tokens[-1]
        running = [self.row(r) for r in self.requests(view, running=True)]
        waiting = self.waiting(view)
        frame = {
            "step": stats.step, "time_s": round(now - self.t0, 3),
            "engine": view.engine_name, "model": view.model_name,
            "policy": view.about.get("policy"),
            "kv_cache_dtype": view.about.get("kv_cache_dtype"),
            "running": running, "waiting": waiting,
            "kv": kv_json(view.snapshot),
            "points": list(self.points),
            "stats": {"num_running": len(running), "num_waiting": len(waiting),
                      "finished": self.num_finished, "preemptions": stats.num_preemptions,
                      "output_tok_s": round((n_b - n_a) / (t_b - t_a), 1) if t_b > t_a else 0.0},
        }
        if (control := stats.batch_control) is not None:    # rung 12: the adaptive batch
            frame["controller"] = {k: control.get(k) for k in CONTROLLER_KEYS}
        if view.has_prefill_pool:                            # rung 11: the other pool
            picture = view.prefill_snapshot
            frame["kv_prefill"] = None if picture is None else kv_json(picture)
        if (moved := loop.metrics.transfers) is not None:
            seconds, nbytes = moved
            frame["transfers"] = {"requests": nbytes.count, "bytes": nbytes.total,
                                  "mean_ms": round(1e3 * seconds.total / seconds.count, 1)}
        self.frame = frame        # whole: the SSE handlers read it from another thread
        self.last_build = now
        self.version += 1

    def waiting(self, view: EngineDetail) -> list[dict]:
        """The waiting queue, then the requests on their way into it, with their stage: with the
        disagg engine those still on their way to the decode pool (prefilling, prefilled, in
        transfer), and those the loop accepted that join the engine at its next step
        (arriving)."""
        rows = [self.row(r, text=False) for r in self.requests(view, running=False)]
        stages = {**view.stages, "arriving": [RequestStats.of(r) for r in self.loop.arriving()]}
        rows += [{**self.row(r, text=False), "stage": stage}
                 for stage, reqs in stages.items() for r in reqs]
        return rows

    def requests(self, view: EngineDetail, running: bool) -> list[RequestStats]:
        """The record's running or waiting requests; for an engine that keeps no such lists, the
        loop's requests in the engine, running once they have a token."""
        if view.running is not None:
            return list(view.running if running else view.waiting)
        started = [RequestStats.of(h.request) for h in self.loop.handles.values()]
        return [r for r in started if bool(r.output_token_ids) == running]

    def row(self, req: RequestStats, text: bool = True) -> dict:
        out = req.output_token_ids                  # n > 1: the first sample's
        row = {"id": req.request_id, "prompt_len": req.prompt_len, "tokens": len(out),
               "max_tokens": req.max_tokens, "n": req.n,
               "preemptions": req.num_preemptions, "priority": req.priority}
        if text:
            row["text"] = self.tokenizer.decode(list(out[-TAIL_TOKENS:]),
                                                skip_special_tokens=True)
        return row


def kv_json(snap: MemorySnapshot) -> dict:
    """The snapshot as JSON the page draws: each row's cell kinds as a string of digits (see
    ``minillm.memory`` for what each digit means), the owner of each row's first owned cell (a
    block, or a batch row, belongs to one request), and whether a block is shared (n > 1)."""
    rows, cols = snap.kind.shape
    keep = min(rows, max(1, MAX_CELLS // max(cols, 1)))
    kinds = ["".join(map(str, r)) for r in snap.kind[:keep].tolist()]
    owned = snap.owner[:keep] >= 0
    first = np.full(keep, -1)
    if keep and cols:   # a contiguous engine's rectangle is empty (0 rows) when it is idle
        first = np.where(owned.any(1), snap.owner[:keep][np.arange(keep), owned.argmax(1)], -1)
    shared = [] if snap.ref_counts is None else (np.asarray(snap.ref_counts)[:keep] > 1).tolist()
    return {"layout": snap.layout, "row_label": snap.row_label, "rows": rows, "cols": cols,
            "shown_rows": keep, "kinds": kinds, "owner": first.tolist(), "owners": snap.owners,
            "shared": shared, "counts": snap.counts.as_dict(),
            "bytes_per_slot": snap.counts.bytes_per_slot}


def add_dashboard(app: FastAPI, loop: EngineLoop, llm) -> Dashboard:
    board = Dashboard(loop, llm.tokenizer)
    board.build(time.perf_counter())   # the loop has not started: its record is built here
    app.state.dashboard = board

    @app.get("/dashboard")
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))

    @app.get("/dashboard/events")
    async def events():
        async def stream():
            board.watchers += 1
            try:
                # frames built before this client came are stale: it gets the next one, built
                # now on the loop thread even if the engine is idle (or after the step running)
                seen = board.version
                loop.call_soon(lambda: board.build(time.perf_counter()))
                t_end, quiet = time.monotonic() + MAX_STREAM_S, 0
                while time.monotonic() < t_end and not loop.stopping:
                    if board.version != seen:
                        seen, quiet = board.version, 0
                        yield f"data: {json.dumps(board.frame)}\n\n"
                    elif (quiet := quiet + 1) % 20 == 0:
                        yield ": keep-alive\n\n"
                    await asyncio.sleep(FRAME_INTERVAL_S)
            finally:
                board.watchers -= 1
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return board
