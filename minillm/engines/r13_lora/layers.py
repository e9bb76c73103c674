"""A linear layer that adds each row's own adapter (rung 13, notebook 13_multi_lora).

``LoRALinear`` wraps one of the core's fused ``Linear``s (q/k/v in one, gate/up in one): the base
product runs once for every row of the step, exactly as in rung 3, then each projection the fused
weight holds gets its rows' low-rank deltas added to its columns of the output (``kernels.py``).
Which slot each row runs with is the step's ``LoRABatch``, set by the runner before the forward
(vLLM's punica wrapper does the same); the core's ``forward_layers`` runs the wrapped layers
unchanged, through ``PagedLlama.with_layers`` (the seam rung 10's shards use too).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ...layers.linear import Linear
from ...core.model import PagedLlama
from .kernels import bgmv, sgmv
from .slots import BASE_SLOT, LoRASlots

# each fused Linear of a layer -> the projections it holds, in its output's column order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


class LoRABatch:
    """Which slot each row of the current step runs with, and its rows grouped by slot."""

    def __init__(self, kernel: str, slots: LoRASlots):
        self.kernel, self.slots = kernel, slots
        self.set_rows(torch.zeros(0, dtype=torch.long))

    def set_rows(self, idx: torch.Tensor) -> None:
        """``idx[t]``: the slot of the step's row ``t``."""
        self.idx = idx
        self.rows = (idx != BASE_SLOT).nonzero().flatten()     # rows with an adapter
        self.row_slots = idx[self.rows]
        # (slot, its rows), for the slots present; the kernels index the stacked A/B by slot - 1
        self.segments = [(int(s), (idx == s).nonzero().flatten())
                         for s in torch.unique(self.row_slots).tolist()]

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """``y += `` each adapter row's delta of ``module`` in ``layer`` (in place)."""
        if not len(self.rows):
            return                                    # a base-only step pays nothing
        A, B = self.slots.A[layer, module], self.slots.B[layer, module]
        if self.kernel == "bgmv":
            bgmv(y, x, A, B, self.rows, self.row_slots - 1)
        elif self.kernel == "triton":
            from .triton_bgmv import triton_bgmv     # imports triton: only when chosen
            triton_bgmv(y, x, A, B, self.rows, self.row_slots - 1)
        else:
            live = self.slots.live[module]
            sgmv(y, x, A, B, [(s - 1, r) for s, r in self.segments if s in live])


class LoRALinear:
    """``base(x) (+ residual)``, then each row's deltas on the columns of each projection."""

    def __init__(self, base: Linear, layer: int, modules: tuple[str, ...],
                 widths: list[int], batch: LoRABatch):
        self.base, self.layer, self.batch = base, layer, batch
        starts = [sum(widths[:i]) for i in range(len(widths))]
        self.parts = [(m, slice(s, s + w)) for m, s, w in zip(modules, starts, widths)]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = self.base(x, residual)
        for module, cols in self.parts:
            self.batch.add(y[:, cols], x, self.layer, module)
        return y

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def out_features(self) -> int:
        return self.base.out_features


def wrap_model(net: PagedLlama, slots: LoRASlots, batch: LoRABatch) -> PagedLlama:
    """``net`` with every projection of every layer a ``LoRALinear`` over ``slots``."""
    layers = []
    for i, w in enumerate(net.layers):
        wrapped = {}
        for name, modules in FUSED.items():
            widths = [slots.B[i, m].shape[1] for m in modules]
            wrapped[name] = LoRALinear(getattr(w, name), i, modules, widths, batch)
        layers.append(replace(w, **wrapped))
    return net.with_layers(layers, net.num_heads, net.num_kv_heads)


def net_shapes(net: PagedLlama) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection the fused weights of ``net`` hold."""
    H, KVH, D = net.num_heads, net.num_kv_heads, net.head_dim
    hidden, inter = net.embed.shape[1], net.layers[0].gate_up.weight.shape[0] // 2
    return {"q_proj": (H * D, hidden), "k_proj": (KVH * D, hidden), "v_proj": (KVH * D, hidden),
            "o_proj": (hidden, H * D), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}
