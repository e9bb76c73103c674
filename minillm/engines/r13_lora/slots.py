"""Device slots for adapters, swapped from host memory least-recently-used first (rung 13,
notebook 13_multi_lora; S-LoRA's unified paging, reduced to whole adapters as vLLM does).

``max_loras`` adapters are resident at once, each in a slot: for every layer and projection a
slice ``A[slot] [max_lora_rank, in]``, ``B[slot] [out, max_lora_rank]`` of one stacked tensor, the
adapter's rank padded with zeros (a zero row of A and column of B add nothing) and its scale folded
into B. Slot 0 is the base model: no delta, so nothing is stored for it (slot ``s`` is row
``s - 1`` of the stacked tensors) and its rows are skipped. An adapter is read from disk once into
host memory (``LoRAAdapter``); a step that needs one that is not resident copies it into a free
slot, or into the least recently used slot that no running request uses. When every slot is in
use the request waits (``acquire`` says None): it is never failed, and a slot is never evicted
from under a request that runs with it.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .adapter import TARGETS, LoRAAdapter

BASE_SLOT = 0


class LoRASlots:
    def __init__(self, shapes: dict[str, tuple[int, int]], num_layers: int, max_loras: int,
                 max_lora_rank: int, device, dtype: torch.dtype):
        """``shapes[module] = (out, in)`` of each projection of ``TARGETS``."""
        n, r = max_loras, max_lora_rank
        self.max_lora_rank = r
        # A[layer, module][s - 1]: slot s's A (B likewise); slot 0, the base model, has none
        self.A = {(i, m): torch.zeros(n, r, shapes[m][1], device=device, dtype=dtype)
                  for i in range(num_layers) for m in TARGETS}
        self.B = {(i, m): torch.zeros(n, shapes[m][0], r, device=device, dtype=dtype)
                  for i in range(num_layers) for m in TARGETS}
        self.names: list[str | None] = [None] * (n + 1)     # slot -> adapter (slot 0: base)
        self.lru: OrderedDict[str, int] = OrderedDict()     # resident adapters, oldest first
        self.live: dict[str, set[int]] = {m: set() for m in TARGETS}   # slots adapting m
        self.loads = self.evictions = 0

    @property
    def num_slots(self) -> int:
        return len(self.names) - 1

    @property
    def nbytes(self) -> int:
        """Device memory the slots take (all of it allocated up front, like the KV pool)."""
        return sum(t.nbytes for t in (*self.A.values(), *self.B.values()))

    def slot_of(self, name: str | None) -> int:
        """The slot ``name`` is resident in (the base model's for None)."""
        if name is None:
            return BASE_SLOT
        if name not in self.lru:
            raise RuntimeError(f"adapter {name!r} runs but has no slot (a bug)")
        return self.lru[name]

    def acquire(self, adapter: LoRAAdapter, busy: set[str]) -> int | None:
        """A slot holding ``adapter``: where it is, or a free one, or the least recently used one
        whose adapter is not ``busy`` (used by a running request), written over; None when all
        are busy. Either way it becomes the most recently used."""
        if adapter.name in self.lru:
            self.lru.move_to_end(adapter.name)
            return self.lru[adapter.name]
        slot = next((s for s in range(1, len(self.names)) if self.names[s] is None), None)
        if slot is None:
            victim = next((n for n in self.lru if n not in busy), None)
            if victim is None:
                return None
            slot = self.lru.pop(victim)
            self.evictions += 1
        self._write(slot, adapter)
        self.lru[adapter.name] = slot
        return slot

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` from host memory into ``slot`` (zeros wherever it adapts nothing)."""
        r, row = adapter.rank, slot - 1
        for key in self.A:
            self.A[key][row].zero_()
            self.B[key][row].zero_()
        for m in TARGETS:
            self.live[m].discard(slot)
        for (layer, m), (a, b) in adapter.weights.items():
            self.A[layer, m][row, :r].copy_(a)
            self.B[layer, m][row, :, :r].copy_(b * adapter.scale)
            self.live[m].add(slot)
        self.names[slot] = adapter.name
        self.loads += 1

    def table(self) -> list[tuple[int, str | None]]:
        """(slot, resident adapter) for each slot but the base's: what a view draws."""
        return [(s, self.names[s]) for s in range(1, len(self.names))]
