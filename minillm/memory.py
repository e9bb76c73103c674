"""One picture of KV-cache memory that every step emits, so one plotting function draws them all.

The KV cache is drawn as a grid of *token slots*: one cell holds one token's keys and values for
every layer (``bytes_per_slot`` bytes). What a row means is the snapshot's ``layout``:

* ``"rectangle"`` (rungs 0-2, contiguous KV): a row is one batch row; columns are positions;
* ``"blocks"`` (rung 3, paged KV): a row is one physical block; columns are its ``block_size`` slots;
* ``"address"`` (the contiguous allocators): one flat address space of ``extra["budget_slots"]``
  slots, wrapped in rows (cells past its end, in the last row, are not memory).

Each cell has a *kind* and an *owner* (an index into ``owners``). The kinds, in the vocabulary of
the vLLM paper (Kwon et al., 2023), which sorts wasted KV memory into three kinds:

* ``TOKEN``    holds a real token of a live request;
* ``RESERVED`` *reserved*: held for tokens a request may still produce (a contiguous allocator
  reserves a request's whole future up front; much of it is never written);
* ``PADDING``  *internal fragmentation* of a rectangle: computed over, holds no token (left
  padding, the rows of requests that left);
* ``TAIL``     *internal fragmentation* of a block: the unfilled slots of a sequence's last block,
  fewer than ``block_size`` per sequence;
* ``FREE``     not allocated (free space too scattered to use is *external fragmentation*: the
  contiguous allocators report it in ``extra["external_slots"]``; paged memory has none);
* ``CACHED``   (paged) a freed block kept because prefix caching may reuse its contents.

``KVCounts`` is the one set of counts of these kinds: every engine step records it, the block
manager and the contiguous allocators report it, and ``MemorySnapshot.counts`` reads the same numbers
off a picture. Waste = allocated slots that hold no token / allocated slots (``waste_fraction``,
the one place that formula is written). Notebooks 02, 03 and 05 teach this.

The pictures are drawn here, from the facts an engine or allocator reports
(``rectangle_snapshot``, ``paged_snapshot``, ``contiguous_snapshot``): an allocator hands out
memory and says who holds what; it draws nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FREE, TOKEN, PADDING, RESERVED, CACHED, TAIL = 0, 1, 2, 3, 4, 5
INTERNAL = (PADDING, TAIL)                       # internal fragmentation
LAYOUTS = ("rectangle", "blocks", "address")


def waste_fraction(token_slots: float, allocated_slots: float) -> float:
    """The share of allocated KV slots that hold no token (0 when nothing is allocated)."""
    return 1.0 - token_slots / allocated_slots if allocated_slots else 0.0


@dataclass
class KVCounts:
    """Slots of each kind: the one set of counts every engine step, block manager, allocator and
    snapshot reports, so every table and plot reads the same numbers. Cheap enough to compute at
    every step without drawing a snapshot (``MemorySnapshot.counts`` gives the same from a
    picture; a test holds the two equal)."""

    token: int = 0          # slots holding a real token
    internal: int = 0       # internal fragmentation: padding (rectangles), block tails (paged)
    reserved: int = 0       # held for tokens a request may still produce
    free: int = 0           # in nobody's hands (rectangles grow on demand: 0)
    cached: int = 0         # paged: freed blocks kept for the prefix cache
    external: int = 0       # of ``free``: holes too small for the request at the head of the queue
    bytes_per_slot: int = 1

    @property
    def allocated(self) -> int:
        return self.token + self.internal + self.reserved

    @property
    def total(self) -> int:
        return self.allocated + self.free + self.cached

    @property
    def waste_fraction(self) -> float:
        return waste_fraction(self.token, self.allocated)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("token", "internal", "reserved", "free", "cached",
                                              "external", "allocated")}


@dataclass
class MemorySnapshot:
    """The KV memory after one engine step. See the module docstring for the cell kinds."""

    engine: str
    step: int
    kind: np.ndarray                  # int8 [rows, cols] of the kinds above
    owner: np.ndarray                 # int32 [rows, cols]: index into ``owners``, -1 for none
    owners: list[str]                 # request ids
    bytes_per_slot: int
    row_label: str = "batch row"      # what a row is, for axis labels only
    ref_counts: np.ndarray | None = None   # paged: sequences sharing each block
    time_s: float = 0.0
    extra: dict = field(default_factory=dict)
    layout: str = "rectangle"         # "rectangle" | "blocks" | "address": what a row means

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @property
    def counts(self) -> KVCounts:
        """The slots of each kind in this picture (external fragmentation is not a cell kind: the
        contiguous allocators record it in ``extra``)."""
        cells = self.kind
        if self.layout == "address":      # cells past the end of the address space are no memory
            cells = cells.reshape(-1)[:self.extra.get("budget_slots", cells.size)]

        def n(*kinds: int) -> int:
            return int(np.isin(cells, kinds).sum())
        return KVCounts(token=n(TOKEN), internal=n(*INTERNAL), reserved=n(RESERVED),
                        free=n(FREE), cached=n(CACHED), external=int(self.extra.get("external_slots", 0)),
                        bytes_per_slot=self.bytes_per_slot)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "step": self.step, "shape": list(self.kind.shape),
                "kind": self.kind.tolist(),
                "owner": self.owner.tolist(), "owners": self.owners,
                "bytes_per_slot": self.bytes_per_slot, "row_label": self.row_label,
                "ref_counts": None if self.ref_counts is None else self.ref_counts.tolist(),
                "time_s": self.time_s, "extra": self.extra, "layout": self.layout}

    @classmethod
    def from_dict(cls, d: dict) -> "MemorySnapshot":
        rc, shape = d.get("ref_counts"), tuple(d["shape"])
        return cls(d["engine"], d["step"], np.array(d["kind"], dtype=np.int8).reshape(shape),
                   np.array(d["owner"], dtype=np.int32).reshape(shape), d["owners"], d["bytes_per_slot"], d.get("row_label", "batch row"),
                   None if rc is None else np.array(rc), d.get("time_s", 0.0), d.get("extra", {}),
                   d.get("layout", "blocks" if d.get("row_label") == "block" else "rectangle"))


def rectangle_snapshot(engine: str, step: int, rows: list[tuple[str, int, int, int]] | list[None],
                       width: int, bytes_per_slot: int) -> MemorySnapshot:
    """Snapshot of a contiguous KV rectangle (rungs 0-2).

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


def rectangle_counts(rows: list[tuple[str, int, int, int]] | list[None], width: int,
                     bytes_per_slot: int, num_rows: int | None = None) -> KVCounts:
    """The counts of ``rectangle_snapshot`` without building the grid (for per-step metrics);
    ``num_rows``: the rectangle's height when it has more rows than ``rows`` lists."""
    tokens = sum(r[2] for r in rows if r is not None)
    reserved = sum(r[3] for r in rows if r is not None)
    area = (len(rows) if num_rows is None else num_rows) * width
    return KVCounts(token=tokens, internal=area - tokens - reserved, reserved=reserved,
                    bytes_per_slot=bytes_per_slot)


def paged_snapshot(engine: str, step: int, bytes_per_slot: int, block_size: int,
                   ref_counts: list[int], cached_blocks: list[int],
                   tables: list[tuple[str, int, list[int]]],
                   fill: dict[int, int]) -> MemorySnapshot:
    """Snapshot of a paged KV pool (rung 3, ``BlockManager``): one row per physical block, one
    column per slot.

    ``ref_counts[b]``: the sequences holding block b; ``cached_blocks``: free blocks the prefix
    cache keeps; ``tables``: (request id, sequence id, block table) of the live sequences in the
    scheduler's order (the first holder of a shared block is drawn as its owner); ``fill[b]``: slots of held block b holding a computed
    token (shared blocks counted once), the rest of a held block is its tail.
    """
    kind = np.full((len(ref_counts), block_size), FREE, dtype=np.int8)
    owner = np.full((len(ref_counts), block_size), -1, dtype=np.int32)
    owners: list[str] = []
    for bid in cached_blocks:
        kind[bid] = CACHED
    for rid, _, table in tables:
        if rid not in owners:
            owners.append(rid)
        for bid in table:
            if owner[bid, 0] == -1:    # first holder is drawn as the owner of a shared block
                owner[bid] = owners.index(rid)
                kind[bid] = TAIL          # internal fragmentation until filled
                kind[bid, :fill.get(bid, 0)] = TOKEN
    return MemorySnapshot(engine, step, kind, owner, owners, bytes_per_slot, "block",
                          np.array(ref_counts),
                          extra={"block_tables": {sid: list(table) for _, sid, table in tables},
                                 "cached_blocks": int((kind[:, 0] == CACHED).sum())},
                          layout="blocks")


def contiguous_snapshot(engine: str, step: int, bytes_per_slot: int, num_slots: int, wrap: int,
                        regions: list[tuple[str, int, int, int]],
                        external_holes: list[tuple[int, int]]) -> MemorySnapshot:
    """Snapshot of one contiguous address space of ``num_slots`` slots (rung 5,
    ``ContiguousAllocator``), wrapped into rows of ``wrap`` slots.

    ``regions``: every region held, in address order, as ``(request_id, start, size, num_tokens)``;
    a region is reserved from its start, its ``num_tokens`` computed tokens first.
    ``external_holes``: the free ``(start, length)`` holes too small for the request at the head
    of the queue (external fragmentation).
    """
    rows = -(-num_slots // wrap)
    kind = np.full(rows * wrap, FREE, dtype=np.int8)
    owner = np.full(rows * wrap, -1, dtype=np.int32)
    owners: list[str] = []
    for rid, start, size, num_tokens in regions:
        if rid not in owners:
            owners.append(rid)
        kind[start:start + size] = RESERVED
        owner[start:start + size] = owners.index(rid)
        kind[start:start + num_tokens] = TOKEN
    return MemorySnapshot(engine, step, kind.reshape(rows, wrap), owner.reshape(rows, wrap),
                          owners, bytes_per_slot, "address row", layout="address",
                          extra={"external_slots": sum(n for _, n in external_holes),
                                 "external_holes": external_holes, "budget_slots": num_slots})
