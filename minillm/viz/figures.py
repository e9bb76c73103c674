"""The key picture of each notebook, as library functions, and ``python -m minillm.viz.figures``.

The notebooks call the ``*_figure`` functions on their own runs; ``main`` (what ``make figures``
runs) performs small runs of the same kind and writes the PNGs into ``figures/``:

    00_kv_cache_cost.png    per-token time without vs with the KV cache, and KV bytes growing
    01_static_batch.png     a static batch: finished requests still holding their slots
    02_dynamic_holes.png    dynamic batching: requests joining and leaving, holes in the rectangle
    03_paged_blocks.png     the paged pool, block tables and blocks shared by parallel samples
    04_kernel_grid.png      which program of the decode kernel's grid reads which block
    05_fragmentation.png    three allocators, one workload, one budget

``--quick`` (or ``MINILLM_QUICK=1``) makes the model runs tiny.
"""
from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from ..memory import PADDING, MemorySnapshot
from .plots import OWNER_COLORS
from .widgets import (ALLOCATOR_COLORS, IDLE, WORKING, LiveMemoryView, compare_figure,
                      draw_snapshot, new_figure, plot_timeline, request_timeline)

FIGURES = Path(__file__).resolve().parents[2] / "figures"
DPI = 110


def quick_mode() -> bool:
    """``MINILLM_QUICK=1``: every notebook and figure runs tiny workloads (tests, CI)."""
    return os.environ.get("MINILLM_QUICK", "") not in ("", "0")


def setup(quick: bool | None = None) -> bool:
    """Notebook preamble: returns whether quick mode is on. In quick mode, and on machines with
    two cores or fewer, torch gets one thread: on a small shared CPU two threads contending with
    other work run many times slower than one (and make the timings in the plots erratic)."""
    quick = quick_mode() if quick is None else quick
    if quick or (os.cpu_count() or 1) <= 2:
        import torch
        torch.set_num_threads(1)
    return quick


def forward_seconds(result) -> float:
    """Time spent in forward passes (the StepRecords' prefill + decode ms): unlike the wall clock,
    it leaves out whatever an ``on_step`` callback (a live view drawing) costs."""
    return sum(s.prefill_ms + s.decode_ms for s in result.steps) / 1000.0


def comparison_table(runs: dict, bytes_per_slot: int | None = None) -> str:
    """One line per engine: steps, wall and forward time, throughput, TTFT, KV peak and waste."""
    head = (f"{'engine':24s} {'steps':>5s} {'wall s':>7s} {'forward s':>9s} {'tok/s':>7s} "
            f"{'TTFT p50':>8s} {'peak KV':>9s} {'KV waste':>8s}")
    lines = [head]
    for name, res in runs.items():
        m = res.metrics
        fwd = forward_seconds(res)
        peak = (f"{m.peak_kv_allocated_bytes / 2**20:7.1f}Mi" if bytes_per_slot is None else
                f"{m.peak_kv_allocated_bytes // bytes_per_slot:6d} sl")
        lines.append(f"{name:24s} {m.num_steps:5d} {m.duration_s:7.2f} {fwd:9.2f} "
                     f"{m.output_tokens / fwd if fwd else 0:7.1f} {m.ttft_p50_s:7.2f}s {peak:>9s} "
                     f"{m.kv_waste_pct:7.1f}%")
    lines.append("(tok/s: output tokens per second of forward time; wall s also counts drawing and "
                 "Python overhead)")
    return "\n".join(lines)


# --- 00: the naive loop ---------------------------------------------------------------------------
def kv_cache_cost_figure(nocache, cached, view: LiveMemoryView, bytes_per_token: int) -> Figure:
    """Left: forward time of every step without vs with the KV cache (one request, one token per
    step). Right: KV bytes held by the cached engine, step by step."""
    fig = new_figure((12, 4))
    ax_t, ax_m = fig.subplots(1, 2)
    for res, label, color in ((nocache, "no KV cache: the whole sequence every step", "#e45756"),
                              (cached, "KV cache: only the newest token", "#4c78a8")):
        ms = [s.prefill_ms + s.decode_ms for s in res.steps]
        ax_t.plot([s.step for s in res.steps], ms, marker="o", ms=3, color=color, label=label)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("engine step (step 1 = the prompt, then one token per step)")
    ax_t.set_ylabel("forward time per step (ms, log scale)")
    ax_t.set_title("what one more token costs", fontsize=10)
    ax_t.legend(fontsize=8)
    held = [(st, b["token"]) for st, b in zip(view.steps(), view.breakdowns) if b["token"]]
    tokens = [n for _, n in held]      # (a finished request's KV is freed: zero, not drawn)
    ax_m.plot([st for st, _ in held], [n * bytes_per_token / 2**20 for n in tokens], marker="o",
              ms=3, color="#4c78a8")
    ax_m.set_xlabel("engine step")
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
    return snap.row_label != "block" and bool((snap.kind == PADDING).all(axis=1).any())


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
        w = [100 * (1 - b["token"] / b["allocated"]) if b["allocated"] else np.nan
             for b in v.breakdowns]
        ax_w.plot(v.steps(), w, drawstyle="steps-post", color=color, label=label)
    ax_w.set_ylim(0, 100)
    ax_w.set_xlabel("engine step")
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
            color = OWNER_COLORS[owner % len(OWNER_COLORS)] if owner >= 0 else "#dddddd"
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
                ax_t.add_patch(Rectangle((i, b), 0.95, 0.9, facecolor=color[p] if p else "#f2f2f2",
                                         edgecolor="white"))
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
            ax_p.add_patch(Rectangle((c, r), 0.95, 0.9, facecolor=color[p] if p else "#f2f2f2",
                                     edgecolor="white"))
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
        ext = [s.external_slots for s in results["exact"].steps] if "exact" in results else []
        run = [s.num_running for s in results["paged"].steps] if "paged" in results else []
        score = [e * (run[i] if i < len(run) else 0) for i, e in enumerate(ext)]
        t = int(np.argmax(score)) if score and max(score) > 0 else \
            len(next(iter(results.values())).steps) // 3
    return compare_figure(results, t)


# --- the runs behind ``make figures`` ---------------------------------------------------------
def _model():
    from ..models import load_model
    return load_model("smollm2-135m-instruct")


def _items(n: int, lengths: list[int], seed: int = 0, categories=("chat",)):
    from ..request import SamplingParams
    from ..workload import make_workload
    items = make_workload(n, seed=seed, categories=categories)
    for it, k in zip(items, lengths):
        it.params = SamplingParams(max_tokens=k, ignore_eos=True)
    return items


def _watch(model, engine: str, items, **options):
    from ..llm import LLM
    from ..workload import to_requests
    llm = LLM(model, engine=engine, **options)
    view = LiveMemoryView()
    result = llm.run(to_requests(llm, items), on_step=view)
    return result, view


def make_00(model, quick: bool) -> Figure:
    items = _items(1, [8 if quick else 32], categories=("long",))
    nocache, _ = _watch(model, "naive-nocache", items)
    cached, view = _watch(model, "naive", items)
    return kv_cache_cost_figure(nocache, cached, view, model.kv_bytes_per_token)


def make_01(model, quick: bool) -> Figure:
    lengths = [3, 8, 5, 2] if quick else [8, 32, 16, 4]
    _, view = _watch(model, "static", _items(4, lengths), batch_size=4)
    return static_batch_figure(view)


def make_02(model, quick: bool) -> Figure:
    lengths = [3, 8, 2, 5, 4, 6] if quick else [6, 28, 4, 14, 10, 20, 8, 12]
    items = _items(len(lengths), lengths)
    _, static = _watch(model, "static", items, batch_size=3)
    _, dynamic = _watch(model, "dynamic", items, max_num_seqs=3)
    return dynamic_holes_figure(dynamic, static)


def make_03(model, quick: bool) -> Figure:
    from ..request import SamplingParams
    lengths = [4, 6, 3] if quick else [12, 20, 8]
    items = _items(len(lengths), lengths)
    items[0].params = SamplingParams(max_tokens=lengths[0], n=3, temperature=0.8, seed=0,
                                     ignore_eos=True)
    _, view = _watch(model, "paged", items, num_blocks=48, block_size=8)
    return paged_blocks_figure(most_shared(view))


def make_04(model, quick: bool) -> Figure:
    tables, ctx = example_block_tables()
    return kernel_grid_figure(tables, ctx, block_size=4, num_blocks=24, num_kv_heads=3)


def make_05(model, quick: bool) -> Figure:
    from .fragmentation import SimConfig, WorkloadSpec, compare
    spec = WorkloadSpec(num_requests=24 if quick else 48, arrival_rate=2.0)
    return fragmentation_figure(compare(spec.make(), SimConfig(max_len=512,
                                                               enable_prefix_caching=False)))


JOBS = {"00_kv_cache_cost": (make_00, True), "01_static_batch": (make_01, True),
        "02_dynamic_holes": (make_02, True), "03_paged_blocks": (make_03, True),
        "04_kernel_grid": (make_04, False), "05_fragmentation": (make_05, False)}


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    p = argparse.ArgumentParser(prog="python -m minillm.viz.figures",
                                description="Regenerate the key figure of every notebook as a PNG "
                                            "(what `make figures` runs).")
    p.add_argument("--quick", action="store_true", help="tiny runs (also MINILLM_QUICK=1)")
    p.add_argument("--out", default=str(FIGURES), help="output folder (default: figures/)")
    p.add_argument("--only", default="", help="comma-separated figure names or prefixes (e.g. 00,05)")
    args = p.parse_args(argv)
    quick = args.quick or quick_mode()
    import torch
    # One thread: on a small shared CPU two contending threads make timings erratic (figure 00
    # plots them), and one is nearly as fast for a 135M model.
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    jobs = {k: v for k, v in JOBS.items() if not only or any(k.startswith(o) for o in only)}
    model = None
    written = []
    for name in (bar := tqdm(list(jobs), desc="figures", unit="fig")):
        bar.set_postfix_str(name)
        make, needs_model = jobs[name]
        if needs_model and model is None:
            model = _model()
        fig = make(model, quick)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=DPI)
        written.append(path)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
