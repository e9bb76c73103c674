"""Contiguous KV allocation, the way servers did it before paging (notebook 05).

Each sequence's KV lives in one contiguous region of a single address space, reserved when its
request is admitted, because a contiguous region cannot grow past its neighbours later:

* ``max-length``: every region is ``max_len`` slots, the longest any request could ever need,
  since the server cannot know how long an answer will be;
* ``exact``: a region of exactly prompt + max_tokens slots (an oracle no real server has), placed
  first-fit. Smaller reservations, but of different sizes: as requests leave, the free space is
  cut into holes, and a newcomer that fits in the total free space may fit in no single hole.

A request with n > 1 samples or beams needs one region per sample, all reserved at admission;
a fork *copies* its parent's tokens into a region of its own (paging shares them instead). Holes
too small for the request at the head of the queue are external fragmentation
(``counts().external``). The scheduler drives this allocator exactly as it drives the
``BlockManager`` (``minillm.engines.r5_allocators.KVAllocator``); a sequence's ``block_table`` holds one
entry, its region's start address.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.block_manager import NoFreeBlocksError
from ...core.sequence import Sequence
from ...memory import KVCounts, MemorySnapshot, contiguous_snapshot
from ...request import Request

MODES = ("max-length", "exact")


@dataclass
class Region:
    start: int
    size: int
    request_id: str
    used_by: Sequence | None = None    # None: reserved for a fork of its request


class ContiguousAllocator:
    def __init__(self, num_slots: int, mode: str = "exact", max_len: int | None = None,
                 wrap: int = 64, max_model_len: int = 1 << 62):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "max-length" and (max_len is None or max_len < 1):
            raise ValueError(f"max-length reservation needs max_len >= 1, got {max_len!r}")
        if num_slots < 1:
            raise ValueError(f"the KV memory must hold at least one slot, got {num_slots}")
        self.num_slots, self.mode, self.max_len, self.wrap = num_slots, mode, max_len, wrap
        self.regions: dict[int, Region] = {}      # start -> region, every region held
        self.prefix_hits = 0                      # no prefix cache: a region is nobody else's
        self.copied_slots = 0                     # token slots copied by forks (paging shares)
        self.max_model_len = max_model_len        # caps an exact region: no token past it

    # --- sizes and places -----------------------------------------------------------------------
    def region_size(self, req: Request) -> int:
        if self.mode == "max-length":
            return self.max_len
        return min(req.prompt_len + req.params.max_tokens, self.max_model_len)

    @staticmethod
    def width(req: Request) -> int:
        return max(req.params.n, req.params.beam_width)

    def holes(self) -> list[tuple[int, int]]:
        """Free (start, length) gaps of the address space, in address order."""
        out, pos = [], 0
        for start in sorted(self.regions):
            if start > pos:
                out.append((pos, start - pos))
            pos = start + self.regions[start].size
        if pos < self.num_slots:
            out.append((pos, self.num_slots - pos))
        return out

    def _place(self, size: int, count: int) -> list[int] | None:
        """First-fit starts for ``count`` regions of ``size`` at once, or None (nothing taken)."""
        holes = [list(h) for h in self.holes()]
        starts = []
        for _ in range(count):
            hole = next((h for h in holes if h[1] >= size), None)
            if hole is None:
                return None
            starts.append(hole[0])
            hole[0] += size
            hole[1] -= size
        return starts

    def _spares(self, req: Request) -> list[Region]:
        return [r for r in self.regions.values()
                if r.request_id == req.request_id and r.used_by is None]

    # --- the allocator interface ----------------------------------------------------------------
    def capacity_error(self, req: Request, longest: int) -> str | None:
        size, width = self.region_size(req), self.width(req)
        if longest > size:
            return f"may grow to {longest} tokens, longer than the {size}-slot reservation"
        if width * size > self.num_slots:
            return (f"needs {width} contiguous region(s) of {size} slots, but the whole KV "
                    f"memory has {self.num_slots} slots")
        return None

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        if seq.block_table:
            return seq.num_computed_tokens + num_new_tokens <= self.regions[seq.block_table[0]].size
        req = seq.request
        if self._spares(req):
            return True
        size = self.region_size(req)
        return num_new_tokens <= size and self._place(size, self.width(req)) is not None

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """A sequence's first call reserves its region (and, for n > 1 or beams, one for each
        sibling to come); later calls only check that the tokens stay inside it."""
        if not self.can_append(seq, num_new_tokens):
            raise NoFreeBlocksError(f"no contiguous room for {seq.request.request_id}")
        if not seq.block_table:
            req = seq.request
            if not self._spares(req):
                size = self.region_size(req)
                for start in self._place(size, self.width(req)):
                    self.regions[start] = Region(start, size, req.request_id)
            self._take(seq)
        return []

    def _take(self, seq: Sequence) -> None:
        """Give ``seq`` a reserved region of its request, or a new one placed first-fit."""
        req = seq.request
        spares = self._spares(req)
        if spares:
            region = spares[0]
        else:
            starts = self._place(self.region_size(req), 1)
            if starts is None:
                raise NoFreeBlocksError(f"no contiguous room for a fork of {req.request_id}")
            region = self.regions[starts[0]] = Region(starts[0], self.region_size(req),
                                                      req.request_id)
        region.used_by = seq
        seq.block_table = [region.start]

    def fork(self, parent: Sequence) -> Sequence:
        """The child gets a region of its own and a copy of every token the parent computed."""
        child = parent.fork()
        child.block_table = []
        self._take(child)
        self.copied_slots += parent.num_computed_tokens
        return child

    def share_prompt(self, src: Sequence, dst: Sequence) -> None:
        """After a preemption, a sibling takes its reserved region back and a copy of the prompt."""
        assert not dst.block_table and src.num_computed_tokens >= src.prompt_len == dst.prompt_len
        self._take(dst)
        dst.num_computed_tokens = src.prompt_len
        self.copied_slots += src.prompt_len

    def free(self, seq: Sequence) -> None:
        """The sequence's region goes back to the address space; when its request holds no other
        region, the regions reserved for its forks go too."""
        if seq.block_table:
            region = self.regions.pop(seq.block_table[0])
            rid = region.request_id
            if not any(r.request_id == rid and r.used_by is not None for r in self.regions.values()):
                for r in self._spares(seq.request):
                    del self.regions[r.start]
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        return 0          # no prefix cache: a region is never shared

    def cache_full_blocks(self, seq: Sequence) -> None:
        pass

    def release_all(self) -> None:
        self.regions.clear()

    # --- reporting ------------------------------------------------------------------------------
    def external(self, head: Request | None) -> list[tuple[int, int]]:
        """Free holes too small for the request at the head of the waiting queue."""
        if head is None:
            return []
        need = self.region_size(head)
        return [h for h in self.holes() if h[1] < need]

    def counts(self, seqs: list[Sequence], bytes_per_slot: int = 1,
               head: Request | None = None) -> KVCounts:
        allocated = sum(r.size for r in self.regions.values())
        tokens = sum(n for *_, n in self.layout())
        return KVCounts(token=tokens, reserved=allocated - tokens, free=self.num_slots - allocated,
                        external=sum(n for _, n in self.external(head)),
                        bytes_per_slot=bytes_per_slot)

    def layout(self) -> list[tuple[str, int, int, int]]:
        """Every region held, in address order: (request id, start, size, tokens its sequence has
        computed; 0 while it is reserved for a fork)."""
        return [(r.request_id, r.start, r.size,
                 0 if r.used_by is None else r.used_by.num_computed_tokens)
                for r in sorted(self.regions.values(), key=lambda r: r.start)]

    def snapshot(self, seqs: list[Sequence], engine: str, step: int, bytes_per_slot: int,
                 head: Request | None = None) -> MemorySnapshot:
        """The address space wrapped into rows of ``wrap`` slots (drawn by
        ``memory.contiguous_snapshot``)."""
        return contiguous_snapshot(engine, step, bytes_per_slot, self.num_slots, self.wrap,
                                   self.layout(), self.external(head))
