"""One picture of KV-cache memory that every step emits, so one plotting function draws them all.

The KV cache is drawn as a grid of *token slots*: one cell holds one token's keys and values for
every layer (``bytes_per_slot`` bytes). What a row means depends on the step:

* steps 0-2 (contiguous KV): a row is one batch row of the padded rectangle; columns are positions.
* step 3 (paged KV): a row is one physical block; columns are the ``block_size`` slots inside it.

Each cell has a *kind* and an *owner*:

* ``TOKEN``    a real token of a live request (owner = index into ``owners``)
* ``PADDING``  allocated and computed over, but holds no token (left padding, rectangle holes)
* ``RESERVED`` allocated for a request's future tokens that may never come
* ``FREE``     not allocated to anyone
* ``CACHED``   (paged only) a freed block kept because its contents may be reused by prefix caching

Waste = allocated slots that hold no token / allocated slots. Notebook 02 and 05 teach this.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FREE, TOKEN, PADDING, RESERVED, CACHED = 0, 1, 2, 3, 4
KIND_NAMES = {FREE: "free", TOKEN: "token", PADDING: "padding", RESERVED: "reserved", CACHED: "cached"}


@dataclass
class KVUsage:
    """The counts behind a snapshot, cheap enough to record at every engine step."""

    allocated_slots: int    # slots some request (or the cache) holds: TOKEN + PADDING + RESERVED
    token_slots: int        # slots that hold a real token
    total_slots: int        # capacity of the pool (0 = grows on demand)
    bytes_per_slot: int

    @property
    def allocated_bytes(self) -> int:
        return self.allocated_slots * self.bytes_per_slot

    @property
    def token_bytes(self) -> int:
        return self.token_slots * self.bytes_per_slot

    @property
    def waste_fraction(self) -> float:
        return 1.0 - self.token_slots / self.allocated_slots if self.allocated_slots else 0.0


@dataclass
class MemorySnapshot:
    """The KV memory after one engine step. See the module docstring for the cell kinds."""

    engine: str
    step: int
    kind: np.ndarray                  # int8 [rows, cols] of FREE/TOKEN/PADDING/RESERVED/CACHED
    owner: np.ndarray                 # int32 [rows, cols]: index into ``owners``, -1 for none
    owners: list[str]                 # request ids
    bytes_per_slot: int
    row_label: str = "batch row"      # "batch row" (steps 0-2) or "block" (step 3)
    ref_counts: np.ndarray | None = None   # paged: sequences sharing each block
    time_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def usage(self) -> KVUsage:
        allocated = int(np.isin(self.kind, (TOKEN, PADDING, RESERVED)).sum())
        return KVUsage(allocated, int((self.kind == TOKEN).sum()), self.kind.size, self.bytes_per_slot)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "step": self.step, "shape": list(self.kind.shape),
                "kind": self.kind.tolist(),
                "owner": self.owner.tolist(), "owners": self.owners,
                "bytes_per_slot": self.bytes_per_slot, "row_label": self.row_label,
                "ref_counts": None if self.ref_counts is None else self.ref_counts.tolist(),
                "time_s": self.time_s, "extra": self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> "MemorySnapshot":
        rc, shape = d.get("ref_counts"), tuple(d["shape"])
        return cls(d["engine"], d["step"], np.array(d["kind"], dtype=np.int8).reshape(shape),
                   np.array(d["owner"], dtype=np.int32).reshape(shape), d["owners"], d["bytes_per_slot"], d.get("row_label", "batch row"),
                   None if rc is None else np.array(rc), d.get("time_s", 0.0), d.get("extra", {}))


def rectangle_snapshot(engine: str, step: int, rows: list[tuple[str, int, int, int]] | list[None],
                       width: int, bytes_per_slot: int) -> MemorySnapshot:
    """Snapshot of a contiguous KV rectangle (steps 0-2).

    ``rows[i]`` is ``(request_id, pad_left, num_tokens, num_reserved)`` laid out left to right
    (padding, then tokens, then reserved slots), or ``None`` for an empty row (a hole).
    """
    kind = np.full((len(rows), width), PADDING, dtype=np.int8)
    owner = np.full((len(rows), width), -1, dtype=np.int32)
    owners: list[str] = []
    for r, row in enumerate(rows):
        if row is None:
            continue
        rid, pad, ntok, nres = row
        owners.append(rid)
        kind[r, pad:pad + ntok] = TOKEN
        kind[r, pad + ntok:pad + ntok + nres] = RESERVED
        owner[r, :pad + ntok + nres] = len(owners) - 1
    return MemorySnapshot(engine, step, kind, owner, owners, bytes_per_slot)


def rectangle_usage(rows: list[tuple[str, int, int, int]] | list[None], width: int,
                    bytes_per_slot: int) -> KVUsage:
    """The counts of ``rectangle_snapshot`` without building the grid (for per-step metrics)."""
    tokens = sum(r[2] for r in rows if r is not None)
    return KVUsage(len(rows) * width, tokens, 0, bytes_per_slot)
