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

import torch

from ..s3_paged.attention import AttentionMetadata
from ..s3_paged.runner import ModelRunner, pad_tables
from ..s3_paged.sequence import Sequence


class VerifyRunner(ModelRunner):
    """Same weights, pools and backend as the runner it wraps; ``verify_ids`` (seq ids) names the
    sequences whose tokens this step are a verification."""

    @classmethod
    def wrap(cls, runner: ModelRunner) -> "VerifyRunner":
        obj = cls.__new__(cls)
        obj.__dict__.update(runner.__dict__)       # shares the tensors: nothing is copied
        obj.verify_ids = set()
        return obj

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        verify = [(s, n) for s, n in scheduled if s.seq_id in self.verify_ids]
        rest = [(s, n) for s, n in scheduled if s.seq_id not in self.verify_ids]
        decodes = [(s, n) for s, n in rest if n == 1] + verify
        prefills = [(s, n) for s, n in rest if n > 1]
        order = decodes + prefills
        ids, pos, slots, last = [], [], [], []
        for seq, n in order:
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            pos += range(start, start + n)
            slots += self.slot_mapping(seq, start, n)
            last.append(len(ids) - 1)
        rows = [(s.block_table, s.num_computed_tokens + i + 1) for s, n in decodes for i in range(n)]
        dev = self.device
        q_lens = [n for _, n in prefills]
        ctx_lens = [s.num_computed_tokens + n for s, n in prefills]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(rows),
            decode_block_tables=pad_tables([t for t, _ in rows], dev),
            decode_context_lens=torch.tensor([c for _, c in rows], dtype=torch.int32, device=dev),
            prefill_block_tables=pad_tables([s.block_table for s, _ in prefills], dev),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            prefill_q_lens=q_lens, prefill_ctx_lens=ctx_lens)
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta, order, last)
