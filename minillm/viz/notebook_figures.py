"""The key picture of each notebook, composed from ``plots.py`` (its palette, its legend).

Pure drawing, called by the notebooks on their own runs and by ``figures.py`` (``make figures``)
on small runs of the same kind:

* 00 ``kv_cache_cost_figure``: per-token time without vs with the KV cache, KV bytes growing;
* 01 ``static_batch_figure``: finished requests still holding their rows of a static batch;
* 02 ``dynamic_holes_figure``: requests joining and leaving, holes in the rectangle;
* 03 ``paged_blocks_figure``: the block pool and block tables, blocks shared by forked samples;
* 04 ``kernel_grid_figure``: which program of the decode kernel's grid reads which block;
* 05 ``fragmentation_figure`` / ``compare_figure``: one workload, one budget, every allocator,
  and ``allocator_figure``, the picture of ``visualizer.FragmentationVisualizer``.
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..memory import FREE, PADDING, MemorySnapshot
from .accounting import ALLOCATOR_LABELS, SimResult
from .plots import (ALLOCATOR_COLORS, BLUE, IDLE, KIND_COLORS, OWNER_COLORS, RED, WORKING,
                    integer_ticks, owner_color,
                    draw_snapshot, memory_legend_handles, new_figure, plot_fragmentation,
                    plot_timeline, request_timeline)

if TYPE_CHECKING:
    from .live_view import LiveMemoryView


# --- 00: the naive loop ---------------------------------------------------------------------------
def kv_cache_cost_figure(nocache, cached, view: LiveMemoryView, bytes_per_token: int) -> Figure:
    """Left: forward time of every step without vs with the KV cache (one request, one token per
    step). Right: KV bytes held by the cached engine, step by step."""
    fig = new_figure((12, 4))
    ax_t, ax_m = fig.subplots(1, 2)
    for res, label, color in ((nocache, "no KV cache: the whole sequence every step", RED),
                              (cached, "KV cache: only the newest token", BLUE)):
        ms = [s.prefill_ms + s.decode_ms for s in res.steps]
        ax_t.plot([s.step for s in res.steps], ms, marker="o", ms=3, color=color, label=label)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("engine step (step 1 = the prompt, then one token per step)")
    ax_t.set_ylabel("forward time per step (ms, log scale)")
    ax_t.set_title("what one more token costs", fontsize=10)
    ax_t.legend(fontsize=8)
    held = [(st, c.token) for st, c in zip(view.steps(), view.counts) if c.token]
    tokens = [n for _, n in held]      # (a finished request's KV is freed: zero, not drawn)
    ax_m.plot([st for st, _ in held], [n * bytes_per_token / 2**20 for n in tokens], marker="o",
              ms=3, color=BLUE)
    ax_m.set_xlabel("engine step")
    integer_ticks(ax_m)
    ax_m.set_ylabel("KV cache (MiB)")
    ax_m.set_title(f"KV memory of the cached loop: +{bytes_per_token / 1024:.0f} KiB per token "
                   f"({tokens[0]} -> {tokens[-1]} tokens)" if tokens else "KV memory", fontsize=10)
    ax_m.ticklabel_format(axis="y", useOffset=False)
    fig.tight_layout()
    return fig


# --- 01 / 02: padded rectangles ---------------------------------------------------------------
def _first_step(view: LiveMemoryView, want) -> int:
    ids, states = request_timeline(view.snapshots)
    for t in range(states.shape[1]):
        if want(states[:, t], view.snapshots[t]):
            return t
    return len(view.snapshots) - 1


def static_batch_figure(view: LiveMemoryView, index: int | None = None) -> Figure:
    """The static batch at a step where some requests are done but still hold their rows, next to
    the timeline of every request."""
    if index is None:   # the first step where a finished request idles beside a working one
        index = _first_step(view, lambda s, _: (s == IDLE).any() and (s == WORKING).any())
    fig = new_figure((12, 4.2))
    ax_mem, ax_tl = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1]})
    draw_snapshot(view.snapshots[index], ax_mem)
    plot_timeline(view.snapshots, ax_tl, title="static batching: red = done, still holding its row")
    ax_tl.axvline(view.snapshots[index].step, color="black", lw=1)
    fig.tight_layout()
    return fig


def _has_hole(snap: MemorySnapshot) -> bool:
    return snap.layout == "rectangle" and bool((snap.kind == PADDING).all(axis=1).any())


def dynamic_holes_figure(view: LiveMemoryView, baseline: LiveMemoryView | None = None,
                         index: int | None = None) -> Figure:
    """Dynamic batching: the rectangle at a step with a hole (a request just left), the timeline
    of requests joining and leaving, and waste over time against ``baseline`` (static)."""
    if index is None:
        index = _first_step(view, lambda _, snap: _has_hole(snap))
    fig = new_figure((15, 4.2))
    ax_mem, ax_tl, ax_w = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.2, 1, 1]})
    draw_snapshot(view.snapshots[index], ax_mem)
    plot_timeline(view.snapshots, ax_tl, title="dynamic batching: requests join as others leave")
    ax_tl.axvline(view.snapshots[index].step, color="black", lw=1)
    for v, label, color in ((baseline, "static", ALLOCATOR_COLORS["max-length"]),
                            (view, "dynamic", ALLOCATOR_COLORS["paged"])):
        if v is None:
            continue
        w = [100 * c.waste_fraction if c.allocated else np.nan for c in v.counts]
        ax_w.plot(v.steps(), w, drawstyle="steps-post", color=color, label=label)
    ax_w.set_ylim(0, 100)
    ax_w.set_xlabel("engine step")
    integer_ticks(ax_w)
    ax_w.set_ylabel("waste % of allocated KV")
    ax_w.set_title("KV waste over the run", fontsize=9)
    ax_w.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- 03: the paged pool -----------------------------------------------------------------------
def plot_block_tables(snap: MemorySnapshot, ax, max_seqs: int = 12):
    """Each sequence's block table: logical block i (column) -> physical block id (the number).
    Colour = the request owning the physical block; a thick edge = shared (ref count > 1)."""
    tables = list(snap.extra.get("block_tables", {}).items())[:max_seqs]
    ax.clear()
    width = max((len(t) for _, t in tables), default=1)
    for r, (seq_id, table) in enumerate(tables):
        for i, bid in enumerate(table):
            owner = int(snap.owner[bid, 0])
            color = owner_color(snap.owners[owner]) if owner >= 0 else KIND_COLORS[FREE]
            shared = snap.ref_counts is not None and snap.ref_counts[bid] > 1
            ax.add_patch(Rectangle((i, r), 0.95, 0.9, facecolor=color,
                                   edgecolor="black" if shared else "white",
                                   lw=2.2 if shared else 0.5))
            ax.text(i + 0.47, r + 0.45, str(bid), ha="center", va="center", fontsize=7,
                    color="white" if shared else "black")
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(len(tables), 0)
    ax.set_yticks([r + 0.45 for r in range(len(tables))], [f"seq {s}" for s, _ in tables],
                  fontsize=7)
    ax.set_xticks([i + 0.47 for i in range(width)], [str(i) for i in range(width)], fontsize=7)
    ax.set_xlabel("logical block (position // block_size)")
    ax.set_title("block tables: the number is the physical block; thick edge = shared", fontsize=9)
    return ax


def paged_blocks_figure(snap: MemorySnapshot) -> Figure:
    fig = new_figure((13, 4.5))
    ax_mem, ax_bt = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.1]})
    draw_snapshot(snap, ax_mem)
    plot_block_tables(snap, ax_bt)
    fig.tight_layout()
    return fig


def most_shared(view: LiveMemoryView) -> MemorySnapshot:
    """The last snapshot where sequences still share blocks: by then forked samples have their
    own (copied-on-write) tails next to the shared prompt blocks."""
    shared = [s for s in view.snapshots if s.ref_counts is not None and (s.ref_counts > 1).any()]
    return shared[-1] if shared else view.snapshots[-1]


# --- 04: the decode kernel's grid -------------------------------------------------------------
def decode_programs(block_tables: list[list[int]], context_lens: list[int], block_size: int,
                    num_splits: int) -> dict[tuple[int, int], list[int]]:
    """(sequence b, split s) -> the physical blocks that program reads, as ``paged_decode`` lays
    out its grid (batch, kv_head, split): every kv head's program reads the same blocks."""
    width = max(len(t) for t in block_tables)
    per_split = -(-width // max(1, min(num_splits, width)))
    splits = -(-width // per_split)
    out = {}
    for b, (table, ctx) in enumerate(zip(block_tables, context_lens)):
        n = -(-ctx // block_size)
        for s in range(splits):
            first = s * per_split
            if first < n:
                out[(b, s)] = table[first:min(first + per_split, n)]
    return out


def kernel_grid_figure(block_tables: list[list[int]], context_lens: list[int], block_size: int,
                       num_blocks: int, num_kv_heads: int = 1, splits: tuple[int, ...] = (1, 2)) -> Figure:
    """For each grid layout: the block tables coloured by the program that reads each block, and
    the physical pool coloured the same way (one program per colour)."""
    fig = new_figure((13, 2.6 * len(splits) + 0.6))
    axes = np.atleast_2d(fig.subplots(len(splits), 2, gridspec_kw={"width_ratios": [1, 1.2]}))
    cols = min(num_blocks, 12)
    for row, num_splits in enumerate(splits):
        progs = decode_programs(block_tables, context_lens, block_size, num_splits)
        color = {p: OWNER_COLORS[(2 * i) % len(OWNER_COLORS)] for i, p in enumerate(progs)}
        reader = {bid: p for p, bids in progs.items() for bid in bids}
        ax_t, ax_p = axes[row]
        width = max(len(t) for t in block_tables)
        for b, (table, ctx) in enumerate(zip(block_tables, context_lens)):
            for i in range(width):
                bid = table[i] if i < len(table) else -1
                p = reader.get(bid) if bid >= 0 and i * block_size < ctx else None
                fill = min(block_size, ctx - i * block_size)
                ax_t.add_patch(Rectangle((i, b), 0.95, 0.9, edgecolor="white",
                                         facecolor=color[p] if p else KIND_COLORS[FREE]))
                label = str(bid) if p else "-"
                if p and fill < block_size:
                    label += f"\n{fill}/{block_size}"
                ax_t.text(i + 0.47, b + 0.45, label, ha="center", va="center", fontsize=7)
        ax_t.set_xlim(0, width)
        ax_t.set_ylim(len(block_tables), 0)
        ax_t.set_yticks([b + 0.45 for b in range(len(block_tables))],
                        [f"seq {b} ({c} tokens)" for b, c in enumerate(context_lens)], fontsize=8)
        ax_t.set_xticks([i + 0.47 for i in range(width)], [str(i) for i in range(width)], fontsize=7)
        ax_t.set_xlabel("logical block")
        nprog = len({s for _, s in progs}) if progs else 1
        ax_t.set_title(f"block tables; grid = (batch {len(block_tables)}, kv heads {num_kv_heads}, "
                       f"splits {nprog}) — colour = program (b, ·, s)", fontsize=9)
        for bid in range(num_blocks):
            r, c = divmod(bid, cols)
            p = reader.get(bid)
            ax_p.add_patch(Rectangle((c, r), 0.95, 0.9, edgecolor="white",
                                     facecolor=color[p] if p else KIND_COLORS[FREE]))
            ax_p.text(c + 0.47, r + 0.45, f"{bid}" + (f"\nb{p[0]} s{p[1]}" if p else ""),
                      ha="center", va="center", fontsize=7)
        ax_p.set_xlim(0, cols)
        ax_p.set_ylim(-(-num_blocks // cols), 0)
        ax_p.set_xticks([])
        ax_p.set_yticks([])
        ax_p.set_title("the physical KV pool: block id and the program (b, s) that reads it",
                       fontsize=9)
    fig.suptitle("paged_decode_kernel: one program per (sequence, kv head, split) walks its blocks "
                 "through the block table", fontsize=10)
    fig.tight_layout()
    return fig


def example_block_tables(seed: int = 0, num_blocks: int = 24, block_size: int = 4,
                         context_lens=(13, 6, 22)) -> tuple[list[list[int]], list[int]]:
    """Block tables as a busy pool hands them out: each sequence's blocks scattered."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    return tables, list(context_lens)


# --- 05: the fragmentation visualizer ---------------------------------------------------------
def fragmentation_figure(results, t: int | None = None) -> Figure:
    """``compare_figure`` at step index ``t`` (default: a step where exact contiguous allocation
    leaves unusable holes while the paged pool runs many requests)."""
    if t is None:   # busy everywhere: the exact allocator has holes while paging is packed
        ext = [s.kv.external for s in results["exact"].steps] if "exact" in results else []
        run = [s.num_running for s in results["paged"].steps] if "paged" in results else []
        score = [e * (run[i] if i < len(run) else 0) for i, e in enumerate(ext)]
        t = int(np.argmax(score)) if score and max(score) > 0 else \
            len(next(iter(results.values())).steps) // 3
    return compare_figure(results, t)


def plot_allocators(results: dict[str, SimResult], ax, value, ylabel: str, t: int,
                    current: str | None = None, now_lw: float = 1.0):
    """One line per allocator: ``value(StepRecord)`` over engine steps, step index ``t`` marked
    (the ``current`` allocator drawn thicker)."""
    for name, res in results.items():
        lw = None if current is None else 2 if name == current else 1
        ax.plot([s.step for s in res.steps], [value(s) for s in res.steps], drawstyle="steps-post",
                color=ALLOCATOR_COLORS[name], label=ALLOCATOR_LABELS[name], lw=lw)
    ax.axvline(t + 1, color="black", lw=now_lw)
    ax.set_xlabel("engine step")
    integer_ticks(ax)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    return ax


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
        waste = 100 * snap.counts.waste_fraction
        draw_snapshot(snap, ax, legend=False, title=(
            f"{ALLOCATOR_LABELS[name]}, step {snap.step}\n{res.steps[k].num_running} running, "
            f"{res.steps[k].num_waiting} waiting, {waste:.0f}% of allocated wasted"))
    series = [("waste % of allocated", lambda s: 100 * s.kv.waste_fraction),
              ("requests running", lambda s: s.num_running),
              ("KV slots holding tokens", lambda s: s.kv.token)]
    for ax, (label, f) in zip(axes[1], series):
        plot_allocators(results, ax, f, label, t)
    budget = next(iter(results.values())).config.budget_slots
    fig.legend(handles=memory_legend_handles(external=True), loc="lower center",
               bbox_to_anchor=(0.5, 0.0), ncol=6, fontsize=8, frameon=False,
               title="memory maps (top row)", title_fontsize=8)
    fig.suptitle(f"The same workload, the same KV budget ({budget} token slots), three allocators",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def allocator_figure(results: dict[str, SimResult], name: str, t: int, fig: Figure) -> Figure:
    """``FragmentationVisualizer``'s picture: allocator ``name``'s memory at step index ``t`` and
    its slots by kind over time; below, waste % and requests running of every allocator."""
    fig.clear()
    axes = fig.subplots(2, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    res = results[name]
    if res.snapshots:
        k = min(t, len(res.snapshots) - 1)
        snap = res.snapshots[k]
        done = " (finished)" if t >= len(res.snapshots) else ""
        u = snap.counts
        draw_snapshot(snap, axes[0, 0], title=(
            f"{ALLOCATOR_LABELS[name]} — step {snap.step}{done}: {u.token} token slots of "
            f"{u.allocated} allocated, {res.steps[k].num_running} running, "
            f"{res.steps[k].num_waiting} waiting"))
    plot_fragmentation([s.step for s in res.steps], [s.kv for s in res.steps], axes[0, 1],
                       current=t + 1,
                       budget=res.config.budget_slots,
                       title=f"{ALLOCATOR_LABELS[name]}: KV slots by kind per step")
    axes[1, 0].set_ylim(0, 100)
    axes[1, 0].set_title("waste over time, every allocator", fontsize=9)
    axes[1, 1].set_title(f"concurrency at the same budget ({res.config.budget_slots} slots)",
                         fontsize=9)
    plot_allocators(results, axes[1, 0], lambda s: 100 * s.kv.waste_fraction, "waste % of allocated",
                    t, current=name, now_lw=1.2)
    plot_allocators(results, axes[1, 1], lambda s: s.num_running, "requests running", t,
                    current=name, now_lw=1.2)
    fig.tight_layout()
    return fig
