"""Static batching made visible, from real runs of ``StaticBatchEngine`` (notebook 01), and the
join/leave trace of a dynamic batch (notebook 02).

Nothing here schedules or computes a token: every function runs the real engine through
``LLM.run`` (a ``LiveMemoryView`` records its snapshots) or reads what a run recorded.

* ``fixed_length_prompts`` / ``record_static_batch``: a small static batch, every row the same
  prompt length, so the rectangle is exactly ``rows x (prompt + max_tokens)`` slots (01);
* ``static_frames_figure`` / ``describe_static_frames``: that batch step by step, small multiples,
  a finished row still holding its slots until the batch ends (01);
* ``batch_size_sweep`` / ``sweep_figure`` / ``sweep_summary``: the same requests at several batch
  sizes, output tokens per second of forward time (01);
* ``join_leave_events``: when each request joined and left a run's KV memory (02).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from ..runtime.driver import RunResult
from ..llm import LLM
from ..memory import FREE, RESERVED, TOKEN, MemorySnapshot
from ..models import LoadedModel
from ..request import SamplingParams
from ..workload import WorkItem, to_requests
from .live_view import LiveMemoryView
from .notebook import forward_seconds
from .plots import (ABSENT, BLUE, GREY, IDLE, draw_snapshot, memory_legend_handles,
                    new_figure, request_timeline)

FONT = 10          # every label of these pictures: readable on a projector
FIG_WIDTH = 12.0


# --- 01: a small static batch, recorded step by step ------------------------------------------
def fixed_length_prompts(llm: LLM, texts: Sequence[str], prompt_len: int) -> list[list[int]]:
    """The first ``prompt_len`` token ids of each text (notebook 01), so that every row of a
    static batch has the same prompt length and no padding."""
    prompts = [llm.encode(t)[:prompt_len] for t in texts]
    short = [t for t, p in zip(texts, prompts) if len(p) < prompt_len]
    if short:
        raise ValueError(f"{short[0]!r} has fewer than {prompt_len} tokens")
    return prompts


def record_static_batch(model: LoadedModel, prompts: Sequence[list[int]],
                        max_tokens: Sequence[int]) -> tuple[RunResult, LiveMemoryView]:
    """Run the real static engine on one batch (``batch_size = len(prompts)``), every request
    producing exactly its ``max_tokens`` (``ignore_eos``); a ``LiveMemoryView`` that is never
    displayed records every step (notebook 01)."""
    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    llm = LLM(model, engine="static", batch_size=len(prompts))
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in max_tokens]
    view = LiveMemoryView(title="static batch, step by step")
    result = llm.run(llm.make_requests([list(p) for p in prompts], params), on_step=view)
    return result, view


def _batch_shape(view: LiveMemoryView) -> tuple[int, int]:
    shapes = [s.kind.shape for s in view.snapshots if s.kind.size]
    return max(shapes) if shapes else (0, 0)


def _row_owner(snap: MemorySnapshot, row: int) -> str | None:
    mine = snap.owner[row][snap.owner[row] >= 0]
    return snap.owners[int(mine[0])] if mine.size else None


def finished_rows(view: LiveMemoryView, index: int) -> list[int]:
    """Rows of snapshot ``index`` whose request computed nothing that step (done, still holding
    its slots), read from the snapshots alone (``plots.request_timeline``; notebook 01)."""
    ids, states = request_timeline(view.snapshots)
    snap = view.snapshots[index]
    rows = []
    for r in range(snap.kind.shape[0]):
        rid = _row_owner(snap, r)
        if rid is not None and states[ids.index(rid), index] == IDLE:
            rows.append(r)
    return rows


def _freed(shape: tuple[int, int], like: MemorySnapshot) -> MemorySnapshot:
    """The batch's rectangle after it ended: every slot given back (drawn as free)."""
    return MemorySnapshot(like.engine, like.step, np.full(shape, FREE, dtype=np.int8),
                          np.full(shape, -1, dtype=np.int32), [], like.bytes_per_slot)


def _frame_title(view: LiveMemoryView, i: int, area: int) -> str:
    snap, rec = view.snapshots[i], view.records[i]
    if not snap.kind.size:
        return f"step {snap.step}: batch over,\nall {area} slots freed"
    what = "prefill" if rec is not None and rec.prefill_ms else "decode"
    c = snap.counts
    return f"step {snap.step} ({what}):\n{c.token} tokens, {c.reserved} reserved"


def _label_tokens(snap: MemorySnapshot, ax, prompt_lens: dict[str, int]) -> None:
    """Write "P" in a row's prompt slots and 1, 2, ... in the slots of its generated tokens."""
    for r in range(snap.kind.shape[0]):
        rid = _row_owner(snap, r)
        cols = np.nonzero(snap.kind[r] == TOKEN)[0]
        if rid is None or rid not in prompt_lens:
            continue
        for k, c in enumerate(cols):
            text = "P" if k < prompt_lens[rid] else str(k - prompt_lens[rid] + 1)
            ax.text(c, r, text, ha="center", va="center", fontsize=FONT - 1, color="white",
                    fontweight="bold")


def _draw_frame(view: LiveMemoryView, i: int, ax, shape: tuple[int, int],
                prompt_lens: dict[str, int]) -> None:
    snap = view.snapshots[i]
    rows, cols = shape
    draw_snapshot(snap if snap.kind.size else _freed(shape, snap), ax, legend=False)
    ax.set_title(_frame_title(view, i, rows * cols), fontsize=FONT)
    ax.set_xlabel("slot", fontsize=FONT)
    ax.set_ylabel("")
    for c in range(1, cols):
        ax.axvline(c - 0.5, color="white", lw=1.0)
    for r in range(1, rows):
        ax.axhline(r - 0.5, color="white", lw=2.0)
    done = finished_rows(view, i) if snap.kind.size else []
    labels = [_row_owner(snap, r) if snap.kind.size else None for r in range(rows)]
    ax.set_yticks(range(rows), [f"req {rid}" + (" done" if r in done else "")
                                if rid is not None else "" for r, rid in enumerate(labels)],
                  fontsize=FONT)
    ax.tick_params(axis="x", labelsize=FONT - 1)
    _label_tokens(snap, ax, prompt_lens)
    for r in done:
        ax.add_patch(Rectangle((-0.5, r - 0.5), cols, 1, fill=False, hatch="//",
                               edgecolor="black", lw=1.5))


def static_frames_figure(view: LiveMemoryView, result: RunResult | None = None,
                         title: str | None = None, max_cols: int = 6) -> Figure:
    """Notebook 01: every step of a recorded static batch as small multiples, the same
    ``rows x width`` rectangle in each; a hatched row is a request that is done but still holds
    its slots (tokens and reserved) until the whole batch ends. With the run's ``result``, a
    row's prompt slots read "P" and its generated tokens 1, 2, ..."""
    prompt_lens = {} if result is None else {o.request_id: len(o.prompt_token_ids)
                                             for o in result.outputs}
    n = len(view.snapshots)
    rows, cols = _batch_shape(view)
    ncols = min(n, max_cols)
    nrows = -(-n // ncols)
    fig = new_figure((FIG_WIDTH, 2.9 * nrows + 1.2))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for i, ax in enumerate(axes):
        if i < n:
            _draw_frame(view, i, ax, (rows, cols), prompt_lens)
        else:
            ax.set_visible(False)
    handles = memory_legend_handles()[:1] + [h for h in memory_legend_handles()[1:]
                                             if h.get_label() in ("reserved", "free")]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//",
                         label="done, still holding its row"))
    if prompt_lens:
        handles[0].set_label("token (colour = request; P = prompt, 1, 2, ... = generated)")
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=FONT,
               frameon=False)
    fig.suptitle(title or f"A static batch: {rows} requests x {cols} slots = {rows * cols} KV "
                          f"slots, reserved at step 1 and held until the last request is done",
                 fontsize=FONT + 1)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


def describe_static_frames(view: LiveMemoryView) -> str:
    """The counts the frames show, one line per step, and how long each finished request held
    its row after its last token (notebook 01)."""
    rows, cols = _batch_shape(view)
    lines = [f"rectangle: {rows} rows x {cols} slots = {rows * cols} KV slots reserved at step 1"]
    ids, states = request_timeline(view.snapshots)
    for i, snap in enumerate(view.snapshots):
        c = snap.counts
        idle = [ids[k] for k in range(len(ids)) if states[k, i] == IDLE]
        lines.append(f"step {snap.step}: {c.token:3d} slots hold tokens, {c.reserved:3d} reserved, "
                     f"{c.internal:3d} padding" + (f"; done but holding: request "
                                                    f"{', '.join(idle)}" if idle else ""))
    for k, rid in enumerate(ids):
        held = int((states[k] == IDLE).sum())
        if held:
            first = view.snapshots[int(np.argmax(states[k] == IDLE))].step
            last = view.snapshots[int(np.nonzero(states[k] != ABSENT)[0][-1])]
            mine = last.owner == last.owners.index(rid)
            tok = int((mine & (last.kind == TOKEN)).sum())
            res = int((mine & (last.kind == RESERVED)).sum())
            lines.append(f"request {rid} was done after step {first - 1} and held its row "
                         f"({tok} token + {res} reserved slots) for {held} more step(s)")
    return "\n".join(lines)


# --- 01: what the batch buys, batch size by batch size ------------------------------------------
@dataclass
class SweepPoint:
    """One static-engine run of the sweep (notebook 01): its batch size and its ``RunResult``;
    every number of the sweep's table and picture is read from that result."""

    batch_size: int
    result: RunResult

    @property
    def output_tokens(self) -> int:
        return self.result.metrics.output_tokens

    @property
    def forward_s(self) -> float:
        return forward_seconds(self.result)

    @property
    def tok_s(self) -> float:
        """Output tokens per second of forward time (StepRecords' prefill_ms + decode_ms)."""
        return self.output_tokens / self.forward_s if self.forward_s else 0.0

    @property
    def num_steps(self) -> int:
        return self.result.metrics.num_steps

    @property
    def decode_step_ms(self) -> float:
        """Mean forward time of a full-batch decode step (every row of the batch, ms)."""
        full = max((s.batch_size for s in self.result.steps if s.decode_ms), default=0)
        ms = [s.decode_ms for s in self.result.steps if s.decode_ms and s.batch_size == full]
        return sum(ms) / len(ms) if ms else 0.0


def batch_size_sweep(model: LoadedModel, items: Sequence[WorkItem], sizes: Sequence[int],
                     warmup: bool = True, repeats: int = 1) -> list[SweepPoint]:
    """Notebook 01: the same requests through the static engine at each batch size (a batch of
    ``b`` runs ``len(items) / b`` batches one after another). ``warmup``: one untimed batch at the
    largest size first; ``repeats``: keep each size's run with the least forward time."""
    if warmup:
        llm = LLM(model, engine="static", batch_size=max(sizes))
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        llm.run(llm.make_requests([it.prompt for it in items[:max(sizes)]], params))
    points = []
    for b in sizes:
        llm = LLM(model, engine="static", batch_size=b)
        runs = [llm.run(to_requests(llm, items)) for _ in range(max(1, repeats))]
        points.append(SweepPoint(b, min(runs, key=forward_seconds)))
    return points


def sweep_figure(points: Sequence[SweepPoint]) -> Figure:
    """Notebook 01. Left: output tokens per second of forward time at each batch size, beside
    what it would be if a step cost the same for any batch. Right: the forward time of one
    decode step of the whole batch."""
    fig = new_figure((FIG_WIDTH, 4.2))
    ax_t, ax_s = fig.subplots(1, 2)
    sizes = [p.batch_size for p in points]
    tok_s = [p.tok_s for p in points]
    base = points[0]
    ax_t.plot(sizes, tok_s, marker="o", color=BLUE, lw=2, label="measured")
    ax_t.plot(sizes, [base.tok_s * b / base.batch_size for b in sizes], ls="--", color=GREY,
              label=f"{base.batch_size}-row rate x rows (a step costing the same for any batch)")
    for b, v in zip(sizes, tok_s):
        ax_t.annotate(f"{v:.0f}", (b, v), textcoords="offset points", xytext=(0, 7),
                      ha="center", fontsize=FONT)
    ax_t.set_ylabel("output tokens / s of forward time", fontsize=FONT)
    ax_t.set_title("throughput of the static engine", fontsize=FONT + 1)
    ms = [p.decode_step_ms for p in points]
    ax_s.bar([str(b) for b in sizes], ms, color=BLUE)
    for i, v in enumerate(ms):
        ax_s.annotate(f"{v:.0f} ms", (i, v), textcoords="offset points", xytext=(0, 3),
                      ha="center", fontsize=FONT)
    ax_s.set_ylabel("one decode step, whole batch (ms)", fontsize=FONT)
    ax_s.set_title("what one step costs: one token for every row", fontsize=FONT + 1)
    for ax in (ax_t, ax_s):
        ax.set_xlabel("batch size (rows per forward pass)", fontsize=FONT)
        ax.tick_params(labelsize=FONT)
    ax_t.set_xscale("log", base=2)
    ax_t.set_xticks(sizes, [str(b) for b in sizes])
    ax_t.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_t.set_ylim(0, max(max(tok_s), base.tok_s * sizes[-1] / base.batch_size) * 1.15)
    ax_t.legend(fontsize=FONT - 1, loc="upper left")
    ax_s.set_ylim(0, max(ms) * 1.2 if max(ms) else 1)
    fig.tight_layout()
    return fig


def sweep_summary(points: Sequence[SweepPoint]) -> str:
    """What the sweep shows, in words computed from its numbers (notebook 01)."""
    base = points[0]
    lines = [f"{'batch':>5s} {'steps':>6s} {'tokens':>6s} {'forward s':>9s} {'tok/s':>7s} "
             f"{'x batch ' + str(base.batch_size):>10s} {'decode step ms':>14s}"]
    for p in points:
        lines.append(f"{p.batch_size:5d} {p.num_steps:6d} {p.output_tokens:6d} {p.forward_s:9.2f} "
                     f"{p.tok_s:7.1f} {p.tok_s / base.tok_s if base.tok_s else 0:10.2f} "
                     f"{p.decode_step_ms:14.1f}")
    best = max(points, key=lambda p: p.tok_s)
    top = points[-1]
    gain = best.tok_s / base.tok_s if base.tok_s else 0.0
    step_ratio = top.decode_step_ms / base.decode_step_ms if base.decode_step_ms else 0.0
    lines.append(f"On this machine the best batch size was {best.batch_size}: {best.tok_s:.0f} "
                 f"output tokens/s, {gain:.1f}x batch {base.batch_size}. A decode step for "
                 f"{top.batch_size} rows took {step_ratio:.1f}x the time of a step for "
                 f"{base.batch_size} ({top.decode_step_ms:.0f} vs {base.decode_step_ms:.0f} ms), "
                 f"for {top.batch_size // base.batch_size}x the tokens.")
    if gain < 1.2:
        lines.append("Batching barely paid here: this CPU was busy computing every row, so a "
                     "bigger batch cost almost proportionally more per step.")
    return "\n".join(lines)


# --- 02: requests joining and leaving ---------------------------------------------------------
def join_leave_events(view: LiveMemoryView, result: RunResult | None = None) -> list[str]:
    """Notebook 02: one line per step where a request joined (first step it holds KV memory) or
    left (first step after that it holds none), read from a run's recorded snapshots. With the
    run's ``result``, requests that never held memory after a step (done in the very step that
    prefilled them) are listed too."""
    ids, states = request_timeline(view.snapshots)
    present = states != ABSENT
    lines = []
    for t, snap in enumerate(view.snapshots):
        was = present[:, t - 1] if t else np.zeros(len(ids), dtype=bool)
        joined = [ids[k] for k in np.nonzero(present[:, t] & ~was)[0]]
        left = [ids[k] for k in np.nonzero(was & ~present[:, t])[0]]
        parts = ([f"request {', '.join(left)} left"] if left else []) + \
            ([f"request {', '.join(joined)} joined"] if joined else [])
        if parts:
            lines.append(f"step {snap.step}: " + "; ".join(parts) +
                         f" ({int(present[:, t].sum())} running)")
    unseen = [o.request_id for o in (result.outputs if result else []) if o.request_id not in ids]
    if unseen:
        lines.append(f"request {', '.join(unseen)}: done in the step that prefilled it, so it "
                     "never held a row after a step")
    return lines
