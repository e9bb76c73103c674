"""Punica's BGMV as one Triton kernel (rung 13, notebook 13_multi_lora; ``lora_kernel="triton"``).

``kernels.bgmv`` does a row's delta ``B[s] @ (A[s] @ x)`` in torch by *copying* each row's A and
B into a batch (``A[idx]``: rows x rank x in floats) before one ``bmm``. The kernel reads them in
place instead: program (t, n) takes row ``rows[t]``, looks up its slot ``s = idx[t]``, computes
the shrink ``A[s] @ x[row]`` (rank values, accumulated in fp32 over blocks of the input) and then
its block ``n`` of the expand, ``B[s][n-block] @ that``, added into ``y[row]``. Each program of a
row recomputes the shrink (rank x in multiply-adds: small beside the expand it feeds) so that
no program waits for another. Rows are distinct, so no two programs write the same output.

Without a GPU the kernel runs in Triton's interpreter (numpy on CPU tensors: exact, slow), as
rung 4's kernels do: ``tests/rungs/test_r13_lora_triton.py`` holds it to ``kernels.delta_reference``.
"""
from __future__ import annotations

import torch

from ...layers.attention.triton import require_triton

require_triton()           # sets TRITON_INTERPRET where there is no GPU, before triton compiles

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BLOCK_K, BLOCK_N = 64, 64


@triton.jit
def _bgmv(y, x, A, B, rows, idx, K, N, R,
          stride_x, stride_y, stride_as, stride_ar, stride_bs, stride_bn,
          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t, nb = tl.program_id(0), tl.program_id(1)
    row = tl.load(rows + t)
    s = tl.load(idx + t)
    r = tl.arange(0, BLOCK_R)
    # the shrink: xa[r] = sum_k A[s, r, k] * x[row, k]
    xa = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        a = tl.load(A + s * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=(r[:, None] < R) & (k[None, :] < K), other=0.0).to(tl.float32)
        xa += tl.sum(a * xv[None, :], axis=1)
    # the expand, this program's block of outputs: y[row, n] += sum_r B[s, n, r] * xa[r]
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.load(B + s * stride_bs + n[:, None] * stride_bn + r[None, :],
                mask=(n[:, None] < N) & (r[None, :] < R), other=0.0).to(tl.float32)
    delta = tl.sum(b * xa[None, :], axis=1)
    out = y + row * stride_y + n
    old = tl.load(out, mask=n < N, other=0.0)
    tl.store(out, (old.to(tl.float32) + delta).to(old.dtype), mask=n < N)


def triton_bgmv(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``y[t] += B[idx[t]] @ (A[idx[t]] @ x[t])`` for each ``t`` of ``rows`` (distinct), in place;
    ``A``: [slots, rank, in], ``B``: [slots, out, rank], both contiguous in their last dim."""
    if not len(rows):
        return y
    slots, rank, k = A.shape
    n = B.shape[1]
    if B.shape != (slots, n, rank) or x.shape[1] != k or y.shape[1] != n:
        raise ValueError(f"triton_bgmv: A {tuple(A.shape)}, B {tuple(B.shape)}, x "
                         f"{tuple(x.shape)}, y {tuple(y.shape)} do not fit together")
    if A.stride(2) != 1 or B.stride(2) != 1 or x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("triton_bgmv: A, B, x and y must be contiguous in their last dimension")
    rows, idx = rows.to(torch.int64).contiguous(), idx.to(torch.int64).contiguous()
    grid = (len(rows), triton.cdiv(n, BLOCK_N))
    _bgmv[grid](y, x, A, B, rows, idx, k, n, rank,
                x.stride(0), y.stride(0), A.stride(0), A.stride(1), B.stride(0), B.stride(1),
                BLOCK_K=BLOCK_K, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_N=BLOCK_N)
    return y
