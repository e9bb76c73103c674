"""``RankMemoryView``: the live KV view of a tensor- or pipeline-parallel engine, one bar per rank
(notebook 10).

Rank 0's block manager hands out the blocks; every rank holds *its part* of each block: its KV
heads (tensor parallelism) of its layers (pipeline parallelism). So each rank's used bytes are the
engine's used slots times that rank's bytes per token (``TensorParallelEngine.kv_bytes_per_rank``).
The view is rung 5's ``LiveMemoryView`` (an ``on_step`` callback, the same block map and slider)
with the fragmentation panel replaced by the ranks' bars at the step shown.
"""
from __future__ import annotations

from matplotlib.figure import Figure

from ..memory import KVCounts
from .live_view import LiveMemoryView
from .plots import draw_snapshot, new_figure

KINDS = (("token", "tab:blue"), ("internal", "tab:orange"), ("reserved", "tab:olive"),
         ("cached", "tab:purple"), ("free", "0.9"))


class RankMemoryView(LiveMemoryView):
    """``LiveMemoryView`` for ranks holding ``bytes_per_rank[r]`` bytes of every token's KV."""

    def __init__(self, bytes_per_rank: list[int], **kwargs):
        super().__init__(**kwargs)
        if not bytes_per_rank or any(b <= 0 for b in bytes_per_rank):
            raise ValueError(f"bytes_per_rank must be positive byte counts, got {bytes_per_rank!r}")
        self.bytes_per_rank = list(bytes_per_rank)

    def figure(self, i: int | None = None, fig: Figure | None = None) -> Figure:
        i = len(self.snapshots) - 1 if i is None else i
        fig = fig or new_figure(self.figsize)
        fig.clear()
        ax_mem, ax_ranks = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.15, 1]})
        if not self.snapshots:
            ax_mem.set_title("no steps yet")
            return fig
        draw_snapshot(self.snapshots[i], ax_mem)
        draw_ranks(self.counts[i], self.bytes_per_rank, ax_ranks,
                   f"{self.title or self.snapshots[i].engine}: KV MiB per rank, step "
                   f"{self.snapshots[i].step}")
        fig.tight_layout()
        return fig


def draw_ranks(counts: KVCounts, bytes_per_rank: list[int], ax, title: str = "") -> None:
    """Stacked bars: each rank's pool in MiB by slot kind (the same slots, its bytes of each)."""
    ranks = range(len(bytes_per_rank))
    left = [0.0] * len(bytes_per_rank)
    for kind, color in KINDS:
        widths = [getattr(counts, kind) * b / 2**20 for b in bytes_per_rank]
        ax.barh(list(ranks), widths, left=left, color=color, label=kind)
        left = [a + w for a, w in zip(left, widths)]
    ax.set_yticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("MiB of KV cache")
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(title, fontsize="medium")
