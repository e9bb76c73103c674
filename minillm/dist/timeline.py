"""Spans a rank records as it runs (``Timeline``), for the views of rungs 7, 10 and 11: each
``Event`` is (rank, kind, micro-batch, start, end) in ``time.time()`` seconds, so that ranks on
different machines can be compared (as well as their clocks agree). What the kinds mean and how
the bubbles are summed up is the pipeline's (``engines/r7_pipeline/timeline.py``, notebook 07)."""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(slots=True)
class Event:
    rank: int
    kind: str          # one of KINDS
    start: float       # time.time() seconds
    end: float
    microbatch: int    # which micro-batch (-1: none, e.g. a control message)


class Timeline:
    """One rank's recorder; ``span`` is cheap enough to leave on (two clock reads)."""

    MAX_EVENTS = 200_000   # a long-running server keeps the most recent ones only

    def __init__(self, rank: int):
        self.rank = rank
        self.events: deque[Event] = deque(maxlen=self.MAX_EVENTS)

    @contextmanager
    def span(self, kind: str, microbatch: int = -1):
        t = time.time()
        try:
            yield
        finally:
            self.events.append(Event(self.rank, kind, t, time.time(), microbatch))

    def clear(self) -> None:
        self.events.clear()
