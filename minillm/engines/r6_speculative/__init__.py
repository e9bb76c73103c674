"""Rung 6 — speculative decoding on the paged engine (notebook 06_speculative_decoding).

A cheap proposer guesses the next k tokens (``proposers.py``); the target model checks all k + 1
positions in one forward, in the same batch as ordinary decodes and prefills; an acceptance rule
keeps the longest correct prefix (``rejection.py``); the block manager truncates the sequence back
to what was kept (``BlockManager.truncate``). ``engine.py`` ties it together; ``trace.py`` is
what notebook 06 watches of it (an observer, ``SpecTrace``).
"""
from .config import SpeculativeConfig
from .trace import SpecTrace, Verification

__all__ = ["SpecTrace", "SpeculativeConfig", "Verification"]
