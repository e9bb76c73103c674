"""Every picture's building blocks, with the one palette and the one memory legend they all use.

Pure matplotlib, no widgets: each function draws into an ``ax`` (or returns a ``Figure`` made by
``new_figure``). Every memory picture is drawn from a ``MemorySnapshot``, so the same function
draws rung 0's single row, rung 2's padded rectangle, rung 3's block pool and the fragmentation
visualizer's allocators. Used by every notebook (00-05) through ``live_view.py``,
``visualizer.py`` and ``notebook_figures.py``, and by ``minillm bench`` (``plot_bench``).

* the palette (every colour of every picture) and ``memory_legend_handles`` (the legend of every
  memory map);
* memory maps: ``plot_memory``, ``draw_snapshot`` (plus address-space layout and external holes);
* over time: ``plot_fragmentation`` (slots by kind), ``live_figure`` (a memory map beside it),
  ``plot_timeline`` (who holds memory, step by step);
* ``plot_bench``: the benchmark at a glance.
"""
from __future__ import annotations

import io
import re
import zlib
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..memory import CACHED, FREE, PADDING, RESERVED, TAIL, TOKEN, KVCounts, MemorySnapshot
from .accounting import WASTE_KINDS

# --- the palette: every colour of every picture, defined here once -----------------------------
BLUE, RED, ORANGE, AMBER, LIGHT_BLUE = "#4c78a8", "#e45756", "#f58518", "#f2b447", "#9ecae9"
LIGHT_GREY, GREY, EDGE_GREY, DARK_GREY = "#f2f2f2", "#bab0ac", "#999999", "#5b5b5b"
WHITE, PINK = "#ffffff", "#f4a6a5"      # pink: a block's unfilled tail (internal, like padding)

KIND_COLORS = {FREE: LIGHT_GREY, PADDING: RED, TAIL: PINK, RESERVED: AMBER, CACHED: LIGHT_BLUE}
# One colour per request, all clearly apart from the kind colours above (no light blue, orange,
# red or grey, which would read as cached, reserved, padding or free).
OWNER_COLORS = tuple(matplotlib.colors.to_rgb(c) for c in (
    "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#393b79",
    "#637939", "#7b4173", "#31a354", "#5254a3", "#a55194", "#8ca252", "#756bb1", "#843c39",
    "#3182bd", "#74c476", "#ce6dbd", "#6b6ecf"))
# The kinds of slots of ``accounting.py`` (charts over time: tokens are one colour there)
WASTE_COLORS = {"token": BLUE, "internal": KIND_COLORS[PADDING], "reserved": KIND_COLORS[RESERVED],
                "external": DARK_GREY}
WASTE_LABELS = {"token": "holding tokens", "internal": "internal (padding / last-block tail)",
                "reserved": "reserved for future tokens", "external": "external (unusable holes)"}
ALLOCATOR_COLORS = {"max-length": RED, "exact": ORANGE, "paged": BLUE}
ABSENT, WORKING, IDLE = 0, 1, 2
TIMELINE_COLORS = {ABSENT: WHITE, WORKING: BLUE, IDLE: RED}

# --- the memory legend: what each cell colour of a memory map means -----------------------------
MEMORY_LEGEND = ((PADDING, "padding / hole"), (TAIL, "block tail"), (RESERVED, "reserved"),
                 (CACHED, "cached (free)"), (FREE, "free"))
EXTERNAL_LABEL = "external (hole too small)"


def memory_legend_handles(external: bool = False) -> list[Patch]:
    """The legend of every memory map (with ``external``: plus holes too small for the next
    request), also for one legend shared by several panels."""
    handles = [Patch(color=OWNER_COLORS[0], label="token (colour = request)")] + \
        [Patch(color=KIND_COLORS[k], label=n) for k, n in MEMORY_LEGEND]
    if external:
        handles.append(Patch(color=WASTE_COLORS["external"], label=EXTERNAL_LABEL))
    return handles


def integer_ticks(ax, which: str = "x") -> None:
    """Steps, rows and slots are whole numbers: never a tick at 2.5."""
    if which in ("x", "both"):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if which in ("y", "both"):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def new_figure(figsize=(12, 4)) -> Figure:
    """A figure outside pyplot: never shown twice by the inline backend, never leaked."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def render_png(fig: Figure, dpi: int = 72) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


# --- memory maps --------------------------------------------------------------------------------
def owner_color(request_id: str) -> tuple[float, float, float]:
    """A request's colour, the same in every frame and panel whoever else is in the picture:
    from the number its id ends with (LLM numbers requests in order, so neighbours differ), or a
    stable hash of the id."""
    digits = re.search(r"(\d+)$", request_id)
    key = int(digits.group(1)) if digits else zlib.crc32(request_id.encode())
    return OWNER_COLORS[key % len(OWNER_COLORS)]


def memory_image(snap: MemorySnapshot) -> np.ndarray:
    """RGB image [rows, cols, 3]: token cells coloured by their request, the rest by kind."""
    img = np.zeros(snap.kind.shape + (3,))
    for kind, color in KIND_COLORS.items():
        img[snap.kind == kind] = matplotlib.colors.to_rgb(color)
    tokens = snap.kind == TOKEN
    if tokens.any():
        palette = np.array([owner_color(rid) for rid in snap.owners] or [OWNER_COLORS[0]])
        img[tokens] = palette[snap.owner[tokens].clip(0, len(palette) - 1)]
    return img


def plot_memory(snap: MemorySnapshot, ax=None, title: str | None = None, max_rows: int = 128):
    """The KV memory map: rows are batch rows (rungs 0-2) or blocks (rung 3)."""
    ax = ax or plt.subplots(figsize=(8, 4))[1]
    rows = snap.kind.shape[0]
    if snap.layout == "blocks" and rows > max_rows:   # show the used part of a big pool
        used = np.nonzero(snap.kind[:, 0] != FREE)[0]
        rows = min(rows, max(max_rows, int(used.max()) + 1 if used.size else 0))
    img = memory_image(snap)[:rows]
    ax.clear()
    if img.size:
        ax.imshow(img, aspect="auto", interpolation="nearest")
    u = snap.counts
    ax.set_title(title or f"{snap.engine} — step {snap.step}: {u.token} token slots of "
                          f"{u.allocated} allocated ({100 * u.waste_fraction:.0f}% waste)",
                 fontsize=10)
    integer_ticks(ax, "both")
    ax.set_ylabel(snap.row_label + "s")
    ax.set_xlabel("slot in block" if snap.layout == "blocks" else "slot (position)")
    if snap.ref_counts is not None and rows <= 48:
        for r in range(rows):
            if snap.ref_counts[r] > 1:
                ax.text(snap.kind.shape[1] - 0.5, r, f"×{snap.ref_counts[r]}", ha="right",
                        va="center", fontsize=9, fontweight="bold",
                        bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
    ax.legend(handles=memory_legend_handles(), loc="upper center", bbox_to_anchor=(0.5, -0.15),
              ncol=5, fontsize=8, frameon=False)
    return ax


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
                          {**snap.extra, "blocks_per_row": blocks_per_row, "block_size": bs},
                          layout="address")


def draw_snapshot(snap: MemorySnapshot, ax, title: str | None = None, max_rows: int = 64,
                  legend: bool = True):
    """``plot_memory`` plus two things: a block pool with more than ``max_rows`` blocks is drawn
    as its address space (several blocks per row, block edges marked), and holes too small for
    the next request (external fragmentation, recorded by the contiguous allocators of
    ``minillm/engines/r5_allocators/``) are shaded."""
    if snap.layout == "blocks" and snap.kind.shape[0] > max_rows:
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
        ax.legend(handles=memory_legend_handles(external=True), loc="upper center",
                  bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=7, frameon=False)
    rows, cols = snap.kind.shape
    if rows <= 12:
        ax.set_yticks(range(rows))
    if cols <= 16:
        ax.set_xticks(range(cols))
    if not legend and ax.get_legend() is not None:
        ax.get_legend().remove()
    return ax


# --- over time ----------------------------------------------------------------------------------
def plot_fragmentation(steps: list[int], counts: list[KVCounts], ax, current: int | None = None,
                       budget: int | None = None, title: str = "KV slots over time"):
    """Stacked slots per kind (token, internal, reserved, external) over steps, waste % on a
    second axis. ``counts``: one ``KVCounts`` per step."""
    ax.clear()
    x = np.asarray(steps)
    parts = {k: [getattr(c, k) for c in counts] for k in WASTE_KINDS}
    kinds = [k for k in WASTE_KINDS if any(parts[k])]
    if len(x):
        ax.stackplot(x, *[parts[k] for k in kinds], colors=[WASTE_COLORS[k] for k in kinds],
                     labels=[WASTE_LABELS[k] for k in kinds], step="post", alpha=0.9)
    if budget:
        ax.axhline(budget, color="black", lw=0.8, ls=":", label="memory budget")
    ax.set_xlabel("engine step")
    integer_ticks(ax)
    ax.set_ylabel("KV slots")
    ax.set_title(title, fontsize=9)
    ax2 = ax.twinx()
    waste = [100 * c.waste_fraction if c.allocated else np.nan for c in counts]
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


def live_figure(snapshots: list[MemorySnapshot], counts: list[KVCounts], i: int | None = None,
                fig: Figure | None = None, figsize=(12, 3.8), budget: int | None = None,
                title: str = "") -> Figure:
    """``LiveMemoryView``'s picture: the memory map at step index ``i`` (default: the last) next
    to ``plot_fragmentation`` of the whole run so far, the current step marked."""
    i = len(snapshots) - 1 if i is None else i
    fig = fig or new_figure(figsize)
    fig.clear()
    ax_mem, ax_frag = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.15, 1]})
    if not snapshots:
        ax_mem.set_title("no steps yet")
        return fig
    snap = snapshots[i]
    draw_snapshot(snap, ax_mem)
    plot_fragmentation([s.step for s in snapshots], counts, ax_frag, current=snap.step,
                       budget=budget, title=f"{title or snap.engine}: KV slots by kind per step")
    fig.tight_layout()
    return fig

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
    integer_ticks(ax)
    ax.set_ylabel("request")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=TIMELINE_COLORS[WORKING], label="computing a token"),
                       Patch(color=TIMELINE_COLORS[IDLE], label="holding KV, idle"),
                       Patch(facecolor=TIMELINE_COLORS[ABSENT], edgecolor=EDGE_GREY,
                             label="not in KV memory")],
              loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=7, frameon=False)
    return ax


# --- the benchmark ------------------------------------------------------------------------------
def plot_bench(results: dict, path: str | Path | None = None):
    """The benchmark at a glance: throughput, latency and KV waste per engine."""
    rows = results["table"]
    names = [r["engine"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = [BLUE if not n.startswith("hf") else GREY for n in names]
    axes[0].barh(names, [r["output_tok_s"] for r in rows], color=colors)
    axes[0].set_xlabel("output tokens / s (higher is better)")
    for i, r in enumerate(rows):
        axes[0].text(r["output_tok_s"], i, f" {r['output_tok_s']:.0f}", va="center", fontsize=8)
    y = np.arange(len(rows))
    axes[1].barh(y - 0.2, [r["ttft_p50_s"] for r in rows], 0.4, label="TTFT p50")
    axes[1].barh(y + 0.2, [r["latency_p95_s"] for r in rows], 0.4, label="latency p95")
    axes[1].set_yticks(y, names)
    axes[1].set_xlabel("seconds (lower is better)")
    axes[1].legend(fontsize=8)
    kv = [(r["engine"], r["kv_waste_pct"]) for r in rows if r["peak_kv_allocated_bytes"]]
    axes[2].barh([k for k, _ in kv], [w for _, w in kv], color=RED)
    axes[2].set_xlabel("KV memory waste % (lower is better)")
    fig.suptitle(f"{results['model']}: {results['requests']} requests "
                 f"({'quick' if results.get('quick') else 'full'} profile)")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
    return fig
