"""Notebook 13's picture of the adapter slots (engines/r13_lora/slots.py): which adapter each slot
held at every step of a run, read from ``LoRAEngine.describe()["lora_slots"]``.

Every colour is in the legend, an empty slot included: a slot with no adapter is drawn white, and
no adapter gets a grey that could be mistaken for it.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from .plots import BLUE, EDGE_GREY, ORANGE, RED, WHITE, new_figure

EMPTY = "empty"
# Adapters in the order given, then around again: saturated, told apart from each other and
# from an empty (white) slot
ADAPTER_COLORS = (BLUE, ORANGE, RED, "#54a24b", "#b279a2", "#72b7b2", "#eeca3b", "#9d755d")


def slot_colors(adapters: Sequence[str]) -> dict[str | None, str]:
    """The colour of each adapter, and of an empty slot (key None)."""
    return {None: WHITE} | {name: ADAPTER_COLORS[i % len(ADAPTER_COLORS)]
                            for i, name in enumerate(adapters)}


def slot_figure(trace: Sequence[tuple[int, Sequence[str | None]]], adapters: Sequence[str],
                title: str = "which adapter each slot holds", figsize=(9, 2.2)):
    """One row per slot, one column per step: ``trace`` is (step, the adapter each slot holds,
    None where it holds none) per step; ``adapters`` names every adapter that can appear (its
    order sets the colours). The legend names every colour drawn."""
    colors = slot_colors(adapters)
    index = {name: i for i, name in enumerate(colors)}
    unknown = {n for _, slots in trace for n in slots} - set(index)
    if unknown:
        raise ValueError(f"slot_figure: adapters {sorted(unknown)} are not among {list(adapters)}")
    grid = np.array([[index[n] for n in slots] for _, slots in trace]).T
    fig = new_figure(figsize)
    ax = fig.subplots()
    steps = [step for step, _ in trace]
    extent = (steps[0] - 0.5, steps[-1] + 0.5, len(grid) - 0.5, -0.5) if steps else None
    ax.imshow(grid if grid.size else np.zeros((1, 1)), aspect="auto", interpolation="nearest",
              cmap=ListedColormap(list(colors.values())), vmin=-0.5, vmax=len(colors) - 0.5,
              extent=extent)
    ax.set_yticks(range(len(grid)), [f"slot {s + 1}" for s in range(len(grid))])
    ax.set_xlabel("step")
    ax.set_title(title)
    handles = [Patch(facecolor=c, edgecolor=EDGE_GREY, label=EMPTY if n is None else n)
               for n, c in colors.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig
