"""Rungs 0-2's engines keep each request's KV in one contiguous row of a rectangle: what they
share beyond the core's ``Engine`` interface (``runtime/interface.py``)."""
from __future__ import annotations

from ..runtime.interface import Engine
from ..memory import KVCounts, MemorySnapshot, rectangle_counts, rectangle_snapshot


class ContiguousEngine(Engine):
    """Rungs 0-2 keep each request's KV in one contiguous row of a rectangle. Each says where its
    rows are (``_rows``: ``(request_id, pad_left, num_tokens, num_reserved)`` or ``None`` for a
    hole, and the width); the counts and the picture follow from that one description."""

    def _rows(self) -> tuple[list, int]:
        raise NotImplementedError

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_counts(self) -> KVCounts:
        rows, width = self._rows()
        return rectangle_counts(rows, width, self.kv_bytes_per_token)

    def snapshot(self) -> MemorySnapshot:
        rows, width = self._rows()
        return rectangle_snapshot(self.name, self.step_count, rows, width,
                                  self.kv_bytes_per_token)
