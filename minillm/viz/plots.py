"""Pictures, one function each. Every memory picture is drawn from a ``MemorySnapshot``, so the
same function draws step 0's single row, step 2's padded rectangle and step 3's block pool."""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ..memory import CACHED, FREE, PADDING, RESERVED, TOKEN, MemorySnapshot

KIND_COLORS = {FREE: "#f2f2f2", PADDING: "#e45756", RESERVED: "#f2b447", CACHED: "#9ecae9"}
# One colour per request, all clearly apart from the kind colours above (no light blue, orange,
# red or grey, which would read as cached, reserved, padding or free).
OWNER_COLORS = tuple(matplotlib.colors.to_rgb(c) for c in (
    "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#393b79",
    "#637939", "#7b4173", "#31a354", "#5254a3", "#a55194", "#8ca252", "#756bb1", "#843c39",
    "#3182bd", "#74c476", "#ce6dbd", "#6b6ecf"))


def memory_image(snap: MemorySnapshot) -> np.ndarray:
    """RGB image [rows, cols, 3]: token cells coloured by owner, the rest by kind."""
    img = np.zeros(snap.kind.shape + (3,))
    for kind, color in KIND_COLORS.items():
        img[snap.kind == kind] = matplotlib.colors.to_rgb(color)
    tokens = snap.kind == TOKEN
    owners = snap.owner[tokens] % len(OWNER_COLORS)
    img[tokens] = np.array(OWNER_COLORS)[owners] if owners.size else img[tokens]
    return img


def plot_memory(snap: MemorySnapshot, ax=None, title: str | None = None, max_rows: int = 128):
    """The KV memory map: rows are batch rows (steps 0-2) or blocks (step 3)."""
    ax = ax or plt.subplots(figsize=(8, 4))[1]
    rows = snap.kind.shape[0]
    if snap.row_label == "block" and rows > max_rows:   # show the used part of a big pool
        used = np.nonzero(snap.kind[:, 0] != FREE)[0]
        rows = min(rows, max(max_rows, int(used.max()) + 1 if used.size else 0))
    img = memory_image(snap)[:rows]
    ax.clear()
    if img.size:
        ax.imshow(img, aspect="auto", interpolation="nearest")
    u = snap.usage
    ax.set_title(title or f"{snap.engine} — step {snap.step}: {u.token_slots} token slots of "
                          f"{u.allocated_slots} allocated ({100 * u.waste_fraction:.0f}% waste)",
                 fontsize=9)
    ax.set_ylabel(snap.row_label + "s")
    ax.set_xlabel("slot (position)" if snap.row_label != "block" else "slot in block")
    if snap.ref_counts is not None and rows <= 48:
        for r in range(rows):
            if snap.ref_counts[r] > 1:
                ax.text(snap.kind.shape[1] - 0.5, r, f"×{snap.ref_counts[r]}", ha="right",
                        va="center", fontsize=7)
    legend = [Patch(color=OWNER_COLORS[0], label="token (colour = request)")] + \
        [Patch(color=c, label=n) for n, c in (("padding / hole", KIND_COLORS[PADDING]),
                                              ("reserved", KIND_COLORS[RESERVED]),
                                              ("cached (free)", KIND_COLORS[CACHED]),
                                              ("free", KIND_COLORS[FREE]))]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=5, fontsize=7,
              frameon=False)
    return ax


def plot_usage(steps, bytes_per_slot: int, ax=None, label: str = ""):
    """Allocated vs token-holding KV over engine steps (from StepRecords)."""
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    x = [s.step for s in steps]
    mib = bytes_per_slot / 2**20
    ax.fill_between(x, [s.allocated_slots * mib for s in steps], step="post", alpha=0.3,
                    label=f"{label} allocated".strip())
    ax.plot(x, [s.token_slots * mib for s in steps], drawstyle="steps-post",
            label=f"{label} holding tokens".strip())
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV memory (MiB)")
    ax.legend(fontsize=8)
    return ax


def plot_waste(steps, ax=None, label: str = ""):
    """Waste % over time: allocated slots that hold no token."""
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    w = [100 * (1 - s.token_slots / s.allocated_slots) if s.allocated_slots else 0 for s in steps]
    ax.plot([s.step for s in steps], w, label=label)
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV waste %")
    ax.set_ylim(0, 100)
    if label:
        ax.legend(fontsize=8)
    return ax


def plot_bench(results: dict, path: str | Path | None = None):
    """The benchmark at a glance: throughput, latency and KV waste per engine."""
    rows = results["table"]
    names = [r["engine"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = ["#4c78a8" if not n.startswith("hf") else "#bab0ac" for n in names]
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
    axes[2].barh([k for k, _ in kv], [w for _, w in kv], color="#e45756")
    axes[2].set_xlabel("KV memory waste % (lower is better)")
    fig.suptitle(f"{results['model']}: {results['requests']} requests "
                 f"({'quick' if results.get('quick') else 'full'} profile)")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
    return fig
