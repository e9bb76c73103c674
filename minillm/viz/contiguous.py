"""The contiguous allocators of the fragmentation visualizer: ``max-length`` and ``exact``.

* ``max-length``: each request reserves ``max_len`` contiguous slots when it is admitted, the
  longest any request could ever need, because the server cannot know how long the answer will be.
* ``exact``: each request reserves exactly ``prompt + max_tokens`` contiguous slots, first-fit in
  one address space. Smaller reservations, but different sizes: when requests leave, the free
  space is cut into holes, and a newcomer that fits in the total free space may fit in no hole.

``ContiguousSim`` runs both with a fake model step (every scheduled token is "computed" at once)
and records the holes too small for the next request (external fragmentation) in each snapshot.
Run through ``allocators.simulate``; used by notebook 05 (``05_fragmentation_visualizer``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..memory import FREE, RESERVED, TOKEN, MemorySnapshot
from .accounting import ALLOCATOR_LABELS, SimConfig, SimStep
from ..workload import SimRequest


@dataclass(eq=False)
class _Seq:
    request: SimRequest
    sample: int
    num_tokens: int
    start: int
    size: int
    num_computed: int = 0
    done: bool = False

    @property
    def num_outputs(self) -> int:
        return self.num_tokens - self.request.prompt_len


@dataclass(eq=False)
class _Group:
    request: SimRequest
    seqs: list[_Seq] = field(default_factory=list)


class ContiguousSim:
    """Every sequence's KV in one contiguous region of a single address space, reserved when the
    request is admitted and freed when it finishes. Regions are placed first-fit; admission is
    strictly first come, first served (the head of the queue waits until a hole fits it, nobody
    overtakes it), so holes that are too small show up as external fragmentation.

    The schedule mirrors the paged one (token budget, chunked prefill, max_num_seqs) so that the
    allocators differ in memory only. With n > 1 each sample needs its own region holding its own
    copy of the prompt, as in a contiguous batch."""

    def __init__(self, cfg: SimConfig, mode: str, max_len: int):
        assert mode in ("max-length", "exact")
        self.cfg, self.mode, self.max_len = cfg, mode, max_len
        self.name = mode
        self.waiting: deque[_Group] = deque()
        self.running: list[_Group] = []
        self.regions: list[_Seq] = []           # live regions, sorted by start
        self.num_finished = 0

    def region_size(self, r: SimRequest) -> int:
        return self.max_len if self.mode == "max-length" else r.prompt_len + r.max_tokens

    def fits(self, r: SimRequest) -> bool:
        return r.n * self.region_size(r) <= self.cfg.budget_slots and \
            r.prompt_len + max(r.output_lens) <= self.region_size(r)

    def add(self, r: SimRequest) -> None:
        self.waiting.append(_Group(r))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def holes(self) -> list[tuple[int, int]]:
        """Free (start, length) gaps of the address space, in address order."""
        out, pos = [], 0
        for s in self.regions:
            if s.start > pos:
                out.append((pos, s.start - pos))
            pos = s.start + s.size
        if pos < self.cfg.budget_slots:
            out.append((pos, self.cfg.budget_slots - pos))
        return out

    def _place(self, sizes: list[int]) -> list[int] | None:
        """First-fit places for all ``sizes`` at once, or None (then nothing is taken)."""
        holes = [list(h) for h in self.holes()]
        starts = []
        for size in sizes:
            for h in holes:
                if h[1] >= size:
                    starts.append(h[0])
                    h[0] += size
                    h[1] -= size
                    break
            else:
                return None
        return starts

    def step(self) -> None:
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        for g in self.running:
            live = [s for s in g.seqs if not s.done]
            if all(s.num_tokens - s.num_computed == 1 for s in live) and len(live) > budget:
                continue                         # samples decode together, or not at all
            for s in live:
                n = min(s.num_tokens - s.num_computed, budget)
                if n == 0:
                    break
                scheduled.append((s, n))
                budget -= n
            if budget == 0:
                break
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            g = self.waiting[0]
            r = g.request
            size = self.region_size(r)
            starts = self._place([size] * r.n)
            if starts is None:
                break                            # strict FCFS: the head waits for a hole
            self.waiting.popleft()
            g.seqs = [_Seq(r, k, r.prompt_len, st, size) for k, st in enumerate(starts)]
            self.regions = sorted(self.regions + g.seqs, key=lambda s: s.start)
            self.running.append(g)
            for s in g.seqs:
                n = min(s.num_tokens, budget)
                if n == 0:
                    break
                scheduled.append((s, n))
                budget -= n
        reached = [s for s, n in scheduled if s.num_computed + n == s.num_tokens]
        for s, n in scheduled:
            s.num_computed += n
        for s in reached:
            s.num_tokens += 1                    # the sampled token: in KV from the next step on
            if s.num_outputs >= s.request.output_lens[s.sample]:
                s.done = True
                self.regions.remove(s)
        for g in [g for g in self.running if all(s.done for s in g.seqs)]:
            self.running.remove(g)
            self.num_finished += 1

    def external(self) -> tuple[int, list[tuple[int, int]]]:
        """Free slots in holes too small for the request at the head of the queue."""
        if not self.waiting:
            return 0, []
        need = self.region_size(self.waiting[0].request)
        small = [h for h in self.holes() if h[1] < need]
        return sum(n for _, n in small), small

    def measure(self, step: int) -> tuple[SimStep, MemorySnapshot | None]:
        allocated = sum(s.size for s in self.regions)
        tokens = sum(s.num_computed for s in self.regions)
        ext, small = self.external()
        rec = SimStep(step, allocated, tokens, 0, allocated - tokens, ext,
                      self.cfg.budget_slots - allocated, 0, len(self.running), len(self.waiting),
                      self.num_finished, 0, 0)
        return rec, (self._snapshot(step, small, ext) if self.cfg.keep_snapshots else None)

    def _snapshot(self, step: int, small: list[tuple[int, int]], ext: int) -> MemorySnapshot:
        budget, wrap = self.cfg.budget_slots, self.cfg.wrap
        rows = -(-budget // wrap)
        kind = np.full(rows * wrap, FREE, dtype=np.int8)
        owner = np.full(rows * wrap, -1, dtype=np.int32)
        owners: list[str] = []
        for s in self.regions:
            rid = s.request.request_id
            if rid not in owners:
                owners.append(rid)
            kind[s.start:s.start + s.size] = RESERVED
            kind[s.start:s.start + s.num_computed] = TOKEN
            owner[s.start:s.start + s.size] = owners.index(rid)
        return MemorySnapshot(ALLOCATOR_LABELS[self.mode], step, kind.reshape(rows, wrap),
                              owner.reshape(rows, wrap), owners, self.cfg.bytes_per_slot,
                              "address row",
                              extra={"external_slots": ext, "external_holes": small,
                                     "budget_slots": budget}, layout="address")
