"""Paged attention in Triton: the kernels of rung 4, to be read top to bottom.

Layout (the same as rung 3): each KV pool is ``[num_blocks, block_size, num_kv_heads, head_dim]``,
and token ``i`` of a sequence lives in block ``block_table[i // block_size]`` at offset
``i % block_size``. Nothing here ever copies a sequence's K/V into a contiguous tensor: every kernel
follows the block table and loads K/V straight from wherever the blocks sit in the pool.

Three ideas carry all the attention kernels:

* **Online softmax.** ``softmax(s) @ V`` over a long context is computed one tile of keys at a time
  while keeping a running max ``m``, a running sum ``l`` of ``exp(s - m)`` and a running, unnormalised
  output ``acc``. When a new tile raises the max, the old ``l`` and ``acc`` are rescaled by
  ``exp(m_old - m_new)``. One pass over K/V, no ``[query, context]`` score matrix in memory.
* **exp2 instead of exp.** ``exp(x) = 2 ** (x * log2(e))``; folding ``log2(e)`` into the softmax
  scale once lets the loop use ``exp2``, which is the GPU's native instruction.
* **fp32 accumulation**, whatever the dtype of the cache: sums of many small terms in fp16 would
  lose the small ones.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634      # log2(e): exp(x) == exp2(x * LOG2E)
MIN_SPLIT_TOKENS = 256          # a decode split shorter than this costs more than it saves


# ----------------------------------------------------------------------------------------------
# 1. store_kv: scatter the new tokens' K/V rows into their cache slots.
# ----------------------------------------------------------------------------------------------
@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_cb, stride_ct, stride_ch,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per (new token, kv head): copy one ``head_dim`` row of K and one of V."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)             # int64: pools can exceed 2**31 elements
    if slot < 0:                             # -1 marks a padding token (vLLM's convention)
        return
    d = tl.arange(0, HEAD_DIM)
    # slot = block * block_size + offset; the pool is 4-D, so split it back into its two indices
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty))
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# 2. decode: one new query token per sequence attends to its whole context.
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attend_blocks(q, k_cache_ptr, v_cache_ptr, table_ptr, ctx, first_block, end_block, kv_head,
                   stride_cb, stride_ct, stride_ch,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_P: tl.constexpr):
    """Online softmax of a query group over blocks ``first_block .. end_block - 1`` of a sequence.

    ``q`` is ``[GROUP_P, HEAD_DIM]`` fp32, already multiplied by ``scale * log2(e)``. Returns the
    running max ``m`` and sum ``l`` (both ``[GROUP_P]``) and the unnormalised output ``acc``.
    """
    tok = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    for i in range(first_block, end_block):
        # The one indirection of paged attention: logical block i -> physical block. int64 so that
        # block * stride cannot overflow on a large pool.
        block = tl.load(table_ptr + i).to(tl.int64)
        valid = i * BLOCK_SIZE + tok < ctx          # only the last block can be partly filled
        offs = block * stride_cb + tok[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        # Scores [GROUP_P, BLOCK_SIZE]. A broadcast multiply-and-sum, not tl.dot: tensor cores need
        # at least 16 rows and a GQA group has 1-8 query heads. Decode is bound by memory traffic
        # (each K/V element is used GROUP times), so the arithmetic units are not the bottleneck.
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = tl.where(valid[None, :], s, float("-inf"))
        # Online softmax step. Every block in the range holds >= 1 valid token, so m_new is finite
        # from the first block on, and exp2(-inf - m_new) = 0 wipes the empty initial state.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)                  # rescales what was accumulated so far
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    return m, l, acc


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr, out_ptr,
                        part_m_ptr, part_l_ptr, part_acc_ptr, qk_scale, blocks_per_split,
                        stride_qb, stride_qh, stride_ob, stride_oh, stride_tb,
                        stride_cb, stride_ct, stride_ch,
                        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
    """Grid (batch, kv head, split). One program serves all GROUP query heads of one KV head.

    Why group: with GQA, H // num_kv_heads query heads read the same K/V. Giving each query head
    its own program would load every K/V block GROUP times; here it is loaded once.

    SPLIT=False (grid's last dimension is 1): the program walks the whole context and writes the
    final output. SPLIT=True (flash-decoding): the program walks only its slice of
    ``blocks_per_split`` blocks and writes the partial ``(m, l, acc)``; ``reduce_splits_kernel``
    then merges the slices. Splitting matters when batch * kv_heads programs are too few to occupy
    the GPU: a batch of 1 with 8 KV heads would otherwise run on 8 of 132 SMs.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    first_block = split * blocks_per_split
    if first_block >= num_blocks:     # this sequence is shorter than the longest: slice is empty
        return                        # (the reduce kernel knows not to read it)
    end_block = tl.minimum(first_block + blocks_per_split, num_blocks)

    g = tl.arange(0, GROUP_P)         # GROUP rounded up to a power of two, as tl.arange requires
    head_ok = g < GROUP
    heads = kv_head * GROUP + g       # query head h uses kv head h // GROUP
    d = tl.arange(0, HEAD_DIM)
    q_offs = b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=head_ok[:, None], other=0.0).to(tl.float32)
    q = q * qk_scale                  # scale once here instead of on every score

    m, l, acc = _attend_blocks(q, k_cache_ptr, v_cache_ptr, table_ptr + b * stride_tb, ctx,
                               first_block, end_block, kv_head, stride_cb, stride_ct, stride_ch,
                               BLOCK_SIZE, HEAD_DIM, GROUP_P)
    if SPLIT:
        # Scratch layout [B, H, num_splits] for m and l, [B, H, num_splits, D] for acc.
        num_splits = tl.num_programs(2)
        row = (b * (tl.num_programs(1) * GROUP) + heads) * num_splits + split
        tl.store(part_m_ptr + row, m, mask=head_ok)
        tl.store(part_l_ptr + row, l, mask=head_ok)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=head_ok[:, None])
    else:
        out = acc / l[:, None]        # l > 0: the context holds at least one token
        out_offs = b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def reduce_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, ctx_ptr, out_ptr,
                         num_heads, num_splits, tokens_per_split, stride_ob, stride_oh,
                         NUM_SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Grid (batch, query head): merge the partial softmaxes of the splits into the output.

    Each split j holds ``l_j = sum exp2(s - m_j)`` and ``acc_j = sum exp2(s - m_j) v``. Bringing
    them to the common max ``M`` multiplies both by ``w_j = exp2(m_j - M)``; then
    ``out = sum_j w_j acc_j / sum_j w_j l_j``: exactly the single-pass result.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    j = tl.arange(0, NUM_SPLITS_P)
    used = j < tl.cdiv(ctx, tokens_per_split)   # splits past this sequence's end wrote nothing
    row = (b * num_heads + h) * num_splits + j
    m = tl.load(part_m_ptr + row, mask=used, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=used, other=0.0)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=used[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))          # split 0 is always used, so the max is finite
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# 3. extend: a chunk of new tokens per sequence attends causally to the cache (prefix + itself).
# ----------------------------------------------------------------------------------------------
@triton.jit
def paged_extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, cu_q_ptr, ctx_ptr, out_ptr,
                        qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_tb,
                        stride_cb, stride_ct, stride_ch,
                        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (sequence, query tile, query head): BLOCK_M queries against BLOCK_N-key tiles.

    Unlike decode, a tile of queries reuses every key it loads BLOCK_M times, so this is compute
    work worth tl.dot (tensor cores). A key tile of BLOCK_N tokens may span several cache blocks
    (block_size 8 is below tl.dot's minimum of 16) or part of one, so each key looks up its own
    physical block: ``block_table[pos // block_size]``.
    """
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:       # the grid is sized for the longest chunk
        return
    ctx = tl.load(ctx_ptr + seq)      # cached + new tokens; the new ones' K/V are already stored
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    pos_q = ctx - q_len + rows        # absolute position of each query in its sequence
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causality: no query of this tile sees past the tile's last query, so stop the walk there.
    kv_end = ctx - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len)
    table = table_ptr + seq * stride_tb
    for start in range(0, kv_end, BLOCK_N):
        pos_k = start + tl.arange(0, BLOCK_N)
        k_ok = pos_k < kv_end
        block = tl.load(table + pos_k // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (pos_k % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k = tl.load(k_cache_ptr + slot[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale    # [BLOCK_M, BLOCK_N]
        # Key 0 is visible to every row (padding rows past q_len included, their pos_q >= 0), so
        # no row is ever fully masked and m stays finite after the first tile: no NaNs.
        s = tl.where((pos_k[None, :] <= pos_q[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Python wrappers: check shapes, pick launch parameters, launch.
# ----------------------------------------------------------------------------------------------
def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels take strides for every dimension but the last, which must be 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    # One set of strides serves both pools; a copy of a cache would be useless (writes are lost).
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1, "the KV pools must be contiguous in head_dim"
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k, v`` [T, num_kv_heads, head_dim] into the pools at ``slot_mapping`` [T]."""
    T, num_kv_heads, head_dim = k.shape
    if T == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    slots = slot_mapping.to(torch.int64).contiguous()
    store_kv_kernel[(T, num_kv_heads)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *_cache_strides(k_cache, v_cache), BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim)


def choose_num_splits(num_programs: int, max_tokens: int, device: torch.device) -> int:
    """How many context slices per sequence for decode: enough programs to fill the GPU."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 4)
    if num_programs >= sms:           # the batch alone fills the GPU: splitting only adds work
        return 1
    # Aim for ~2 programs per SM, but keep every slice long enough to be worth its partial write.
    return max(1, min(triton.cdiv(2 * sms, num_programs), max_tokens // MIN_SPLIT_TOKENS))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
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
    blocks_per_split = triton.cdiv(max_blocks, max(1, min(num_splits, max_blocks)))
    num_splits = triton.cdiv(max_blocks, blocks_per_split)    # no slice starts past the table
    split = num_splits > 1
    if split:
        part_m = torch.empty(B, H, num_splits, device=q.device, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(B, H, num_splits, D, device=q.device, dtype=torch.float32)
    else:                             # unused by the single-pass kernel; any tensor will do
        part_m = part_l = part_acc = out
    paged_decode_kernel[(B, num_kv_heads, num_splits)](
        q, k_cache, v_cache, tables, ctx, out, part_m, part_l, part_acc, scale * LOG2E,
        blocks_per_split, q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        *_cache_strides(k_cache, v_cache), GROUP=group, GROUP_P=triton.next_power_of_2(group),
        BLOCK_SIZE=block_size, HEAD_DIM=D, SPLIT=split)
    if split:
        reduce_splits_kernel[(B, H)](
            part_m, part_l, part_acc, ctx, out, H, num_splits, blocks_per_split * block_size,
            out.stride(0), out.stride(1), NUM_SPLITS_P=triton.next_power_of_2(num_splits),
            HEAD_DIM=D)
    return out


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, max_q_len: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
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
    grid = (num_seqs, triton.cdiv(max_q_len, block_m), H)
    paged_extend_kernel[grid](
        q, k_cache, v_cache, tables, cu, context_lens.to(torch.int32).contiguous(), out,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        *_cache_strides(k_cache, v_cache), GROUP=H // num_kv_heads, BLOCK_SIZE=block_size,
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
        # fp32 inputs: by default tl.dot would use TF32 (10-bit mantissa) on NVIDIA GPUs
        PRECISION="ieee" if q.dtype == torch.float32 else None)
    return out
