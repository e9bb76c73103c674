"""How the fragmentation visualizer counts KV memory: the kinds of slots, one budget, the books.

Each step of a replay is a ``StepRecord`` (``minillm.metrics``), the engine's own, whose ``kv``
counts (``minillm.memory.KVCounts``) sort the slots into the kinds of the vLLM paper:

* ``token``: holds the K/V of a computed token;
* ``internal``: allocated, but no token sits there and none is reserved for a known future token:
  the unfilled tail of a sequence's last block (paged), or padding (the rectangles of rungs 0-2).
  At most ``block_size - 1`` slots per sequence when paged;
* ``reserved``: held for tokens a request may still produce (the contiguous allocators reserve a
  request's whole future up front; much of it is never written);
* ``external``: free, but unusable: slots in free holes too small for the request at the head of
  the waiting queue. Zero when nobody is waiting, and always zero when paged (any free block is as
  good as any other);
* waste = (internal + reserved) / allocated = ``1 - token / allocated`` (``memory.waste_fraction``,
  the same formula as the engines' ``RunMetrics.kv_waste_pct``).

``SimConfig`` is what every allocator shares (one budget of ``budget_slots``, one scheduler's
limits); ``SimResult`` is one allocator's run. Used by notebook 05 (``05_fragmentation_visualizer``)
through ``replay.py`` and ``visualizer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..memory import MemorySnapshot, waste_fraction
from ..metrics import StepRecord

ALLOCATOR_LABELS = {"max-length": "max-length reservation", "exact": "exact contiguous",
                    "paged": "paged (BlockManager)"}
WASTE_KINDS = ("token", "internal", "reserved", "external")


@dataclass
class SimConfig:
    """What every allocator shares: one memory budget and one scheduler's limits."""

    budget_slots: int = 4096                # KV memory in token slots, the same for every allocator
    block_size: int = 16                    # paged only; the pool has budget_slots // block_size blocks
    max_num_batched_tokens: int = 512       # tokens one step may compute (chunked prefill)
    max_num_seqs: int = 64                  # requests running at once
    max_len: int | None = None              # max-length reservation; default: the longest request
    enable_prefix_caching: bool = True      # paged: only matters when prompts share a prefix
    policy: str = "fcfs"
    policy_options: dict = field(default_factory=dict)  # SchedulerConfig's weights, by name
    max_model_len: int = 1 << 30            # context limit for stopping (the trace's model's)
    bytes_per_slot: int = 1
    validate: bool = True                   # paged: reject requests that could never fit (off
                                            # for traces: the engine accepted all of them)
    idle_steps: bool = True                 # count steps where nothing runs (synthetic timelines)
    keep_snapshots: bool = True
    wrap: int = 64                          # columns when drawing a contiguous address space

    @property
    def num_blocks(self) -> int:
        return self.budget_slots // self.block_size


@dataclass
class SimResult:
    allocator: str
    config: SimConfig
    steps: list[StepRecord]
    snapshots: list[MemorySnapshot]
    num_requests: int
    rejected: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """One row of notebook 05's table (time-averaged like ``RunMetrics.kv_waste_pct``)."""
        def total(kind: str) -> int:
            return sum(getattr(s.kv, kind) for s in self.steps)
        alloc = total("allocated")
        budget = self.config.budget_slots * max(1, len(self.steps))
        return {
            "allocator": self.allocator,
            "waste_pct": 100.0 * waste_fraction(total("token"), alloc),
            "internal_pct": 100.0 * total("internal") / alloc if alloc else 0.0,
            "reserved_pct": 100.0 * total("reserved") / alloc if alloc else 0.0,
            "external_pct_of_budget": 100.0 * total("external") / budget,
            "peak_running": max((s.num_running for s in self.steps), default=0),
            "mean_running": float(np.mean([s.num_running for s in self.steps])) if self.steps else 0.0,
            "peak_token_slots": max((s.kv.token for s in self.steps), default=0),
            "steps": len(self.steps),
            "preemptions": self.steps[-1].num_preemptions if self.steps else 0,
            "prefix_hit_tokens": self.steps[-1].prefix_hit_tokens if self.steps else 0,
            "rejected": len(self.rejected),
        }


def summary_table(results: dict[str, SimResult]) -> str:
    """Plain-text table of ``SimResult.summary`` rows (notebooks show an HTML one)."""
    cols = [("allocator", "allocator", "{}"), ("waste_pct", "waste %", "{:.1f}"),
            ("external_pct_of_budget", "external % of pool", "{:.1f}"),
            ("peak_running", "peak running", "{}"), ("steps", "steps", "{}"),
            ("preemptions", "preemptions", "{}")]
    rows = [[fmt.format(r.summary()[k]) for k, _, fmt in cols] for r in results.values()]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, (_, h, _) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for (_, h, _), w in zip(cols, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
