"""The low-rank deltas of a batch that mixes adapters (rung 13, notebook 13_multi_lora).

Every row ``t`` of a step that runs with an adapter uses the one in slot ``idx[t]`` (the rows of
the base model are left out by the caller: their delta is zero). Its delta is ``B[idx[t]] @ (A[idx[t]] @ x[t])``; the base model's product
``W x`` was computed once for all rows beforehand (the core's ``Linear``). Two ways to batch the
deltas, Punica's two kernels (S-LoRA and vLLM use the same):

* ``bgmv`` -- batched gather matrix-vector: every row gathers its own slot's A and B and one
  batched matmul does them all. One launch whatever the mix; made for decode (one row per
  request), and it multiplies each row by its own copy of the weights.
* ``sgmv`` -- segmented gather: the rows of each adapter taken together, one pair of matmuls per
  adapter present in the step. Made for prefill (many rows per adapter): each adapter's weights are
  read once for all its rows.

Both touch only the rows they are given (a batch of base requests pays nothing) and return ``y``
with the deltas added in place. ``tests/rungs/test_r13_lora.py`` checks they agree with each other and with the merged
weights.
"""
from __future__ import annotations

import torch

BGMV_CHUNK = 64     # rows gathered at once: bounds the [rows, out, rank] copy of B


def sgmv(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         segments: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """``y[rows] += (x[rows] @ A[s].T) @ B[s].T`` for each (slot ``s``, its ``rows``)."""
    for slot, rows in segments:
        xa = x.index_select(0, rows) @ A[slot].T            # [n, rank]: the shrink
        y.index_add_(0, rows, xa @ B[slot].T)              # [n, out]: the expand
    return y


def bgmv(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
         rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``y[t] += B[idx[t]] @ (A[idx[t]] @ x[t])`` for each ``t`` of ``rows`` (``idx``: their
    slots), in chunks of ``BGMV_CHUNK`` rows."""
    for i in range(0, len(rows), BGMV_CHUNK):
        r, s = rows[i:i + BGMV_CHUNK], idx[i:i + BGMV_CHUNK]
        xa = torch.bmm(A[s], x.index_select(0, r).unsqueeze(-1))     # [n, rank, 1]
        y.index_add_(0, r, torch.bmm(B[s], xa).squeeze(-1))          # [n, out]
    return y


def delta_reference(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    idx: torch.Tensor) -> torch.Tensor:
    """The deltas of every row one by one: what both kernels must equal."""
    return torch.stack([B[s] @ (A[s] @ x[t]) for t, s in enumerate(idx.tolist())]) \
        if len(idx) else x.new_zeros((0, B.shape[1]))
