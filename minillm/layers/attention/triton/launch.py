"""The Python side of rung 4's kernels (``kernels.py``): check shapes, pick launch parameters,
launch the kernel it is handed. ``kernels.paged_decode(...)`` etc. hand over their own jitted
kernels, so that is the usual way in (and this module never imports ``kernels``).

This module imports without triton (like every module but ``kernels`` and ``backend``: see
tests/layers/test_triton_optional.py); the kernels are imported on the first launch.

Rung 9's narrow pools (``layers/kv_quant.py``) arrive as their two tensors: ``k_cache``/``v_cache``
hold the stored rows (int8, fp8 or 16 bits) and ``k_scale``/``v_scale`` ``[num_blocks,
block_size, num_kv_heads]`` fp32 their scales (None for the 16-bit formats, which have none).
"""
from __future__ import annotations

import torch

from ...kv_quant import FORMATS

LOG2E = 1.4426950408889634      # log2(e): exp(x) == exp2(x * LOG2E)
MIN_SPLIT_TOKENS = 256          # a decode split shorter than this costs more than it saves


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels take strides for every dimension but the last, which must be 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    # One set of strides serves both pools; a copy of a cache would be useless (writes are lost).
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1, "the KV pools must be contiguous in head_dim"
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def _scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> tuple:
    """(k_scale, v_scale, stride_sb, stride_st, SCALED) for a launch. Without scales the data pool
    stands in for both pointers: SCALED=False compiles every read of them away."""
    if k_scale is None:
        assert v_scale is None, "scales for both pools or neither"
        return k_cache, k_cache, 0, 0, False
    # One set of strides serves both scale pools; a head's scale sits next to the previous head's.
    assert k_scale.shape == v_scale.shape == k_cache.shape[:-1], "one scale per stored row"
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
    assert k_scale.dtype == v_scale.dtype == torch.float32
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1), True


def _qmax(stored: torch.dtype) -> float:
    """The largest stored magnitude of a scaled format (int8: 127, fp8: 448), by its type."""
    for fmt in FORMATS.values():
        if fmt.scaled and fmt.storage == stored:
            return fmt.qmax
    raise ValueError(f"no scaled KV cache format stores {stored}")


def store_kv(store_kv_kernel, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write ``k, v`` [T, num_kv_heads, head_dim] into the pools at ``slot_mapping`` [T].

    A pool stored in another type than ``k`` (rung 9) is written narrow: quantized with a scale
    per row into ``k_scale``/``v_scale`` where they are given (int8, fp8), else rounded to its
    16-bit type; the result equals ``QuantizedPool.index_copy_``'s."""
    T, num_kv_heads, head_dim = k.shape
    if T == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    slots = slot_mapping.to(torch.int64).contiguous()
    k_s, v_s, stride_sb, stride_st, scaled = _scale_args(k_cache, k_scale, v_scale)
    assert scaled or k_cache.element_size() > 1, "an int8 or fp8 pool needs its scales"
    store_kv_kernel[(T, num_kv_heads)](
        k, v, k_cache, v_cache, k_s, v_s, slots, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *_cache_strides(k_cache, v_cache), stride_sb, stride_st,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        NARROW=scaled or k_cache.dtype != k.dtype, QMAX=_qmax(k_cache.dtype) if scaled else 0.0)


def choose_num_splits(num_programs: int, max_tokens: int, device: torch.device) -> int:
    """How many context slices per sequence for decode: enough programs to fill the GPU."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 4)
    if num_programs >= sms:           # the batch alone fills the GPU: splitting only adds work
        return 1
    # Aim for ~2 programs per SM, but keep every slice long enough to be worth its partial write.
    return max(1, min(_cdiv(2 * sms, num_programs), max_tokens // MIN_SPLIT_TOKENS))


def paged_decode(paged_decode_kernel, reduce_splits_kernel, q: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 num_splits: int | None = None, out: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: sequence b attends to its first ``context_lens[b]`` cached tokens.

    ``num_splits`` None chooses automatically; 1 forces the single-pass kernel, more forces
    flash-decoding. The split size comes from the block table's width (an upper bound on every
    context length), which avoids reading ``context_lens`` back to the CPU.
    """
    B, H, D = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = H // num_kv_heads
    q = _rows_contiguous(q)
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    ctx = context_lens.to(torch.int32).contiguous()
    max_blocks = tables.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(B * num_kv_heads, max_blocks * block_size, q.device)
    blocks_per_split = _cdiv(max_blocks, max(1, min(num_splits, max_blocks)))
    num_splits = _cdiv(max_blocks, blocks_per_split)          # no slice starts past the table
    split = num_splits > 1
    if split:
        part_m = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32)
    else:                             # unused by the single-pass kernel; any tensor will do
        part_m = part_l = part_acc = out
    k_s, v_s, stride_sb, stride_st, scaled = _scale_args(k_cache, k_scale, v_scale)
    paged_decode_kernel[(B, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_s, v_s, tables, ctx, out, part_m, part_l, part_acc, scale * LOG2E,
        blocks_per_split, q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        *_cache_strides(k_cache, v_cache), stride_sb, stride_st, GROUP=group,
        GROUP_P=_next_power_of_2(group), BLOCK_SIZE=block_size, HEAD_DIM=D, SPLIT=split,
        SCALED=scaled)
    if split:
        reduce_splits_kernel[(B, H)](
            part_m, part_l, part_acc, ctx, out, H, num_splits, blocks_per_split * block_size,
            out.stride(0), out.stride(1), NUM_SPLITS_P=_next_power_of_2(num_splits),
            HEAD_DIM=D)
    return out


def paged_extend(paged_extend_kernel, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, max_q_len: int | None = None,
                 out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (every sequence's new tokens, flat) -> [T, H, D], causal over the cache.

    ``max_q_len`` sizes the grid; pass it when known to skip a device-to-host read.
    """
    T, H, D = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    q = _rows_contiguous(q)
    out = torch.empty_like(q) if out is None else out
    num_seqs = cu_seqlens_q.numel() - 1
    if T == 0 or num_seqs == 0:
        return out
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    if max_q_len is None:
        max_q_len = int((cu[1:] - cu[:-1]).max())
    on_gpu = q.device.type == "cuda"
    # tl.dot needs tiles of >= 16. Bigger tiles reuse more on a GPU; the interpreter prefers small.
    block_m = 64 if on_gpu and max_q_len > 16 else 16
    block_n = 64 if on_gpu else 16
    tables = block_tables.to(torch.int32).contiguous()
    grid = (num_seqs, _cdiv(max_q_len, block_m), H)
    k_s, v_s, stride_sb, stride_st, scaled = _scale_args(k_cache, k_scale, v_scale)
    paged_extend_kernel[grid](
        q, k_cache, v_cache, k_s, v_s, tables, cu, context_lens.to(torch.int32).contiguous(), out,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        *_cache_strides(k_cache, v_cache), stride_sb, stride_st, GROUP=H // num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        # fp32 inputs: by default tl.dot would use TF32 (10-bit mantissa) on NVIDIA GPUs
        PRECISION="ieee" if q.dtype == torch.float32 else None, SCALED=scaled)
    return out
