"""``VerifyRunner``: the paged ``ModelRunner`` with verification laid out as decodes (notebook 06).

Checking k guesses means running 1 + k new tokens of one sequence, each attending to the
sequence's cache up to its own position. The paged runner would treat them as a prefill chunk,
and its reference attention handles chunks one sequence at a time (a gather and a mask per
sequence per layer): fine for a few long prompts, slow for 64 sequences of 5 tokens. But token i
of the chunk is exactly a decode whose context ends at its own position — its K/V and the ones
before it are written into the blocks before attention reads them — so the 1 + k tokens become
1 + k decode rows sharing the sequence's block table, with context lengths c + 1 ... c + k + 1,
and the whole verification runs in the batched decode attention beside the ordinary decodes.
"""
from __future__ import annotations

from ...core.runner import ModelRunner
from ...core.sequence import Sequence


class VerifyRunner(ModelRunner):
    """The paged ``ModelRunner``, built through its ``__init__`` by ``SpeculativeEngine``;
    ``verify_ids`` (seq ids) names the sequences whose tokens this step are a verification."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.verify_ids: set[int] = set()

    def split(self, scheduled: list[tuple[Sequence, int]]):
        """Verifications join the decodes: their 1 + k tokens become 1 + k decode rows."""
        verify = [(s, n) for s, n in scheduled if s.seq_id in self.verify_ids]
        rest = [(s, n) for s, n in scheduled if s.seq_id not in self.verify_ids]
        return [(s, n) for s, n in rest if n == 1] + verify, [(s, n) for s, n in rest if n > 1]
