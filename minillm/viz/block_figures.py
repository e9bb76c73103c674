"""Notebook 03's pictures, drawn from the real ``BlockManager`` or a real ``PagedEngine`` run.

* ``block_table_figure`` (the vLLM paper's: words in logical blocks -> physical blocks, ref
  counts), ``capture`` + ``frames_figure`` (fork, append with copy-on-write, free: one panel each);
* ``beam_refcount_figure``, ``prefix_cache_figure``: blocks shared, freed, cached, taken back;
* the scheduler at work (chunked prefill, priorities, preemption): ``schedule_figures.py``.
Nothing here schedules or allocates: it reads what the engine did (block tables, ``ref_counts``,
``StepRecord``s, snapshots).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from ..core.block_manager import BlockManager
from ..core.sequence import Sequence
from ..memory import CACHED, FREE, TAIL, TOKEN, MemorySnapshot
from ..metrics import StepRecord
from .plots import (BLUE, DARK_GREY, GREY, KIND_COLORS, ORANGE, OWNER_COLORS, RED,
                    memory_legend_handles, new_figure, plot_timeline, request_timeline)

Words = Callable[[int], str] | Mapping[int, str]
Seqs = Mapping[str, Sequence]
FS = 10                                   # font size of every label here (projector-readable)
REF_COLORS = {1: BLUE, 2: OWNER_COLORS[2], 3: DARK_GREY}   # ref count 1, 2, 3 and more


def _word(words_of: Words, tok: int) -> str:
    return words_of.get(tok, str(tok)) if isinstance(words_of, Mapping) else words_of(tok)


def label_axes(ax, title: str, ylabel: str, legend: int = 0, handles=None,
               int_y: bool = False) -> None:
    """Title and labels at a readable size, integer steps (and counts, ``int_y``); with
    ``legend`` columns, the legend under the axes (never over the bars)."""
    ax.set_title(title, fontsize=FS)
    ax.set_xlabel("engine step", fontsize=FS)
    ax.set_ylabel(ylabel, fontsize=FS)
    for axis in (ax.xaxis, ax.yaxis) if int_y else (ax.xaxis,):
        axis.set_major_locator(MaxNLocator(integer=True))
    if legend:
        ax.legend(**({"handles": handles} if handles else {}), loc="upper center", fontsize=9,
                  bbox_to_anchor=(0.5, -0.16), ncol=legend, frameon=False)


def timeline(snapshots: list[MemorySnapshot], ax, title: str,
              extra: Callable | None = None) -> list[str]:
    """``plot_timeline`` with labels of at least 9 points and integer steps; ``extra(ax, ids)``
    draws more on it and returns artists for the legend. Returns the request ids (rows)."""
    plot_timeline(snapshots, ax, title=title)
    ids = request_timeline(snapshots)[0]
    handles = list(ax.get_legend().legend_handles) + (list(extra(ax, ids)) if extra else [])
    label_axes(ax, title, "request", len(handles), handles)
    ax.tick_params(labelsize=9)
    return ids


# --- 1. the block table, as in the vLLM paper ----------------------------------------------------
def physical_contents(bm: BlockManager, seqs: Seqs) -> dict[int, list[int]]:
    """Token ids in each physical block's slots: the computed tokens of the sequences that list
    it, or, for a freed block the prefix cache keeps, the tokens its hash stands for."""
    bs = bm.block_size
    out = {b.block_id: list(b.key[1]) for b in bm.blocks if b.ref_count == 0 and b.key}
    for s in seqs.values():
        for i, bid in enumerate(s.block_table):
            toks = s.token_ids[i * bs:min(s.num_computed_tokens, (i + 1) * bs)]
            if len(toks) > len(out.get(bid, [])):
                out[bid] = toks
    return out


def _cell(ax, x: float, y: float, color, word: str, gid: str, dark: bool, fs: int) -> None:
    ax.add_patch(Rectangle((x, y), 0.96, 0.8, facecolor=color, edgecolor="white", lw=1))
    if word:   # a long word is shortened on screen; the text keeps it whole in ``.word``
        short = word if len(word) <= 5 or fs > 9 else word[:4] + "…"
        t = ax.text(x + 0.48, y + 0.42, short, ha="center", va="center", fontsize=fs, gid=gid,
                    color="white" if dark else "black")
        t.word = word


def _draw_logical(ax, seqs: Seqs, words_of: Words, color: dict, bs: int, x0: float, y: float,
                  fs: int) -> float:
    """Each sequence's logical blocks (its computed words; the rest is its last block's tail),
    an arrow from each to its physical block. Returns the y under the last one."""
    for name, s in seqs.items():
        for i, bid in enumerate(s.block_table):
            for j in range(bs):
                done = i * bs + j < s.num_computed_tokens
                _cell(ax, j, y, color[name] if done else KIND_COLORS[TAIL],
                      _word(words_of, s.token_ids[i * bs + j]) if done else "",
                      f"log:{name}:{i}:{j}", done, fs)
            ax.text(-0.15, y + 0.42, f"{name}·{i}", ha="right", va="center", fontsize=fs)
            ax.annotate("", xy=(x0 - 0.6, bid + 0.42), xytext=(bs + 0.1, y + 0.42),
                        arrowprops=dict(arrowstyle="-|>", color=color[name], lw=1.6))
            y += 1
        y += 0.5
    return y


def _draw_pool(ax, bm: BlockManager, seqs: Seqs, words_of: Words, color: dict, x0: float,
               fs: int) -> None:
    """Every physical block: its slots (words of a held or cached block), id and ref count."""
    holder = {bid: n for n, s in reversed(list(seqs.items())) for bid in s.block_table}
    contents = physical_contents(bm, seqs)
    for bid, b in enumerate(bm.blocks):
        cached = b.ref_count == 0 and b.hash is not None
        toks = contents.get(bid, []) if b.ref_count or cached else []
        for j in range(bm.block_size):
            word = _word(words_of, toks[j]) if j < len(toks) else ""
            k = (TOKEN if word else TAIL) if b.ref_count else CACHED if cached else FREE
            c = color.get(holder.get(bid), GREY) if k == TOKEN else KIND_COLORS[k]
            _cell(ax, x0 + j, bid, c, word, f"phys:{bid}:{j}", k == TOKEN, fs)
        ax.text(x0 - 0.1, bid + 0.42, str(bid), ha="right", va="center", fontsize=fs,
                color=DARK_GREY)
        ax.text(x0 + bm.block_size + 0.1, bid + 0.42, f"ref {b.ref_count}", ha="left",
                va="center", fontsize=fs + 1, fontweight="bold" if b.ref_count > 1 else "normal",
                gid=f"ref:{bid}", color="black" if b.ref_count else DARK_GREY)


def draw_block_table(ax, bm: BlockManager, seqs: Seqs, words_of: Words,
                     copies: list[tuple[int, int]] = (), title: str | None = None,
                     colors: Mapping[str, int] | None = None, fs: int = FS):
    """Into ``ax``: logical blocks of ``seqs`` (name -> Sequence) left, the pool right. Texts carry
    gids ``log:<name>:<block>:<slot>`` and ``phys:<block>:<slot>`` (attribute ``word``: the whole
    word); the blocks of ``copies`` (``append_slots``' (src, dst) pairs) are outlined in orange,
    gid ``copied:<dst>``. ``colors``: name -> index into ``OWNER_COLORS``."""
    bs, nb = bm.block_size, bm.num_blocks
    colors = colors or {name: i for i, name in enumerate(seqs)}
    color = {n: OWNER_COLORS[colors[n] % len(OWNER_COLORS)] for n in seqs}
    x0 = bs + 2.6                                  # where the pool starts (arrows in between)
    rows = sum(len(s.block_table) for s in seqs.values()) + 0.5 * max(0, len(seqs) - 1)
    y = _draw_logical(ax, seqs, words_of, color, bs, x0, max(0.0, (nb - rows) / 2), fs)
    _draw_pool(ax, bm, seqs, words_of, color, x0, fs)
    for src, dst in copies:
        ax.add_patch(Rectangle((x0 - 0.06, dst - 0.06), bs + 0.08, 0.92, fill=False,
                               edgecolor=ORANGE, lw=3, gid=f"copied:{dst}"))
    ax.text(bs / 2, -0.7, "logical blocks", ha="center", fontsize=fs)
    ax.text(x0 + bs / 2, -0.7, "physical blocks (pool)", ha="center", fontsize=fs)
    ax.set_xlim(-1.3, x0 + bs + 1.9)
    ax.set_ylim(max(nb, y) + 0.1, -1.3)
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=fs + 1, loc="left")
    return ax


def _legend(fig: Figure, copies: bool) -> None:
    """The memory legend (tokens coloured by sequence here) and the copy-on-write outline."""
    handles = memory_legend_handles()
    handles[0] = Patch(color=OWNER_COLORS[0], label="token (colour = sequence)")
    handles = [h for h in handles if h.get_label() not in ("padding / hole", "reserved")]
    if copies:
        handles.append(Patch(fill=False, edgecolor=ORANGE, lw=3, label="copied on write"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=FS, frameon=False)


def block_table_figure(bm: BlockManager, seqs: Seqs, words_of: Words,
                       copies: list[tuple[int, int]] = (), title: str | None = None) -> Figure:
    """The block tables of ``seqs`` (name -> Sequence) and the pool of ``bm``, with the words."""
    fig = new_figure((12, 0.42 * bm.num_blocks + 1.6))
    draw_block_table(fig.subplots(), bm, seqs, words_of, copies, title)
    _legend(fig, bool(copies))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# --- 2. fork, append, free: one frame per operation ----------------------------------------------
@dataclass
class Frame:
    """One panel of ``frames_figure``: the block manager and sequences after an operation."""
    title: str
    bm: BlockManager
    seqs: dict[str, Sequence]
    copies: list[tuple[int, int]]


def capture(bm: BlockManager, seqs: Seqs, title: str, copies=()) -> Frame:
    """``bm`` and ``seqs`` as they are now, deep-copied: later operations leave the frame be."""
    bm2, seqs2 = copy.deepcopy((bm, dict(seqs)))
    return Frame(title, bm2, seqs2, list(copies))


def frames_figure(frames: list[Frame], words_of: Words, ncols: int = 2) -> Figure:
    """Small multiples: one ``draw_block_table`` panel per frame, each sequence one colour."""
    names = list(dict.fromkeys(n for f in frames for n in f.seqs))
    nrows = -(-len(frames) // ncols)
    nb = max(f.bm.num_blocks for f in frames)
    fig = new_figure((12, nrows * (0.36 * nb + 1.2) + 0.6))
    axes = np.atleast_1d(fig.subplots(nrows, ncols)).ravel()
    for k, (ax, f) in enumerate(zip(axes, frames)):
        draw_block_table(ax, f.bm, f.seqs, words_of, f.copies, f"{k + 1}. {f.title}",
                         {n: names.index(n) for n in f.seqs}, fs=9)
    for ax in axes[len(frames):]:
        ax.set_axis_off()
    _legend(fig, any(f.copies for f in frames))
    fig.tight_layout(rect=(0, 0.04, 1, 1), w_pad=0.2)
    return fig


# --- 3. beam search: ref counts over time ------------------------------------------------------
def ref_history(snapshots: list[MemorySnapshot]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Steps, ref counts [step, block], and the blocks whose ref count fell to 0 at each step."""
    ref = np.array([s.ref_counts for s in snapshots])
    before = np.vstack([np.zeros_like(ref[:1]), ref[:-1]])
    return [s.step for s in snapshots], ref, (before > 0) & (ref == 0)


def beam_refcount_figure(snapshots: list[MemorySnapshot], title: str = "beam search") -> Figure:
    """Left: each block's ref count per step (× = fell to 0: freed). Right: blocks held with ref
    count 1, 2, 3+ per step, and (below zero) the blocks freed."""
    steps, ref, freed = ref_history(snapshots)
    used = np.nonzero((ref > 0).any(axis=0))[0]
    fig = new_figure((12, max(4.5, 0.3 * len(used) + 1.8)))
    ax_h, ax_b = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.3, 1]})
    img = np.ones((len(used), len(steps), 3))
    for k, c in REF_COLORS.items():
        img[np.minimum(ref[:, used].T, 3) == k] = to_rgb(c)
    for r, bid in enumerate(used):
        for t, n in enumerate(ref[:, bid]):
            if n:
                ax_h.text(steps[t], r, str(n), ha="center", va="center", fontsize=9, color="white")
            elif freed[t, bid]:
                ax_h.text(steps[t], r, "×", ha="center", va="center", fontsize=12, color=RED,
                          fontweight="bold", gid=f"freed:{steps[t]}:{bid}")
    ax_h.imshow(img, aspect="auto", interpolation="nearest",
                extent=(steps[0] - 0.5, steps[-1] + 0.5, len(used) - 0.5, -0.5))
    ax_h.set_yticks(range(len(used)), [str(b) for b in used], fontsize=9)
    label_axes(ax_h, f"{title}: ref count of each block (× = fell to 0, freed)", "physical block")
    bottom = np.zeros(len(steps))
    for k, label in ((1, "ref count 1"), (2, "ref count 2"), (3, "ref count 3+")):
        h = (ref == k).sum(1) if k < 3 else (ref >= 3).sum(1)
        ax_b.bar(steps, h, bottom=bottom, color=REF_COLORS[k], label=label)
        bottom += h
    ax_b.bar(steps, -freed.sum(1), color=RED, label="freed this step (ref count → 0)")
    ax_b.axhline(0, color="black", lw=0.8)
    label_axes(ax_b, "blocks held, by ref count, and blocks freed", "blocks (freed below 0)", 2,
           int_y=True)
    fig.tight_layout()
    return fig


# --- 4. the prefix cache ---------------------------------------------------------------------
def prefix_cache_figure(snapshots: list[MemorySnapshot], records: list[StepRecord]) -> Figure:
    """Left: prompt tokens computed vs served from the prefix cache, per step. Right: blocks held,
    of which taken back from the cache this step, and cached (freed, kept) blocks."""
    steps = [r.step for r in records]
    hits = np.diff([0] + [r.prefix_hit_tokens for r in records])
    fig = new_figure((12, 4))
    ax_t, ax_b = fig.subplots(1, 2)
    computed = [r.num_prefill_tokens for r in records]
    ax_t.bar(steps, computed, color=BLUE, label="prompt tokens computed")
    ax_t.bar(steps, hits, bottom=computed, color=KIND_COLORS[CACHED],
             label="prompt tokens from the prefix cache")
    label_axes(ax_t, "each step: prompt computed, or read from the cache", "tokens", 1)
    kind = [s.kind[:, 0] for s in snapshots]
    cached = np.array([(k == CACHED).sum() for k in kind])
    held = np.array([((k != FREE) & (k != CACHED)).sum() for k in kind])
    reused = np.array([0] + [int(((a == CACHED) & (b != FREE) & (b != CACHED)).sum())
                             for a, b in zip(kind, kind[1:])])
    ax_b.bar(steps, held - reused, color=BLUE, label="blocks held")
    ax_b.bar(steps, reused, bottom=held - reused, color=ORANGE,
             label="… taken back from the cache")
    ax_b.bar(steps, cached, bottom=held, color=KIND_COLORS[CACHED], label="cached (free, kept)")
    label_axes(ax_b, "blocks: a finished request's full blocks stay cached, the next takes them",
           "KV blocks", 1, int_y=True)
    ax_b.set_ylim(0, 1.08 * max(1, int((held + cached).max())))
    fig.tight_layout()
    return fig
