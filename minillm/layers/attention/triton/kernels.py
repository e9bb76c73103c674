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

Rung 9 (``layers/kv_quant.py``) narrows the pool: rows stored in int8 or fp8 with one fp32 scale per
(token, KV head) in a scale pool ``[num_blocks, block_size, num_kv_heads]``, or in 16 bits without
one. The store kernel quantizes as it writes; the attention kernels widen each row as they load it
and fold its scale into that key's score and that value's weight -- a ``tl.constexpr`` flag
(``SCALED``) compiles that in, so the unscaled kernels are the same as before.

The Python side (shape checks, launch parameters) is ``launch.py``; the three functions at the end
of this file hand it these kernels, so ``kernels.paged_decode(...)`` launches one.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import launch
from .launch import LOG2E, MIN_SPLIT_TOKENS, choose_num_splits  # noqa: F401 (rung 4's names)


# ----------------------------------------------------------------------------------------------
# 1. store_kv: scatter the new tokens' K/V rows into their cache slots.
# ----------------------------------------------------------------------------------------------
@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    NARROW: tl.constexpr, QMAX: tl.constexpr):
    """One program per (new token, kv head): copy one ``head_dim`` row of K and one of V.

    NARROW (rung 9): the pool stores rows in another type than K/V arrive in; each row goes
    through ``_encode_row`` (with a scale into the scale pool when QMAX > 0: int8, fp8)."""
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
    if NARROW:
        s_dst = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_st + h
        _encode_row(k, k_cache_ptr + dst, k_scale_ptr + s_dst, QMAX)
        _encode_row(v, v_cache_ptr + dst, v_scale_ptr + s_dst, QMAX)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def _encode_row(x, dst, scale_dst, QMAX: tl.constexpr):
    """Encode one row [HEAD_DIM] into the pool's storage type on write (``QMAX > 0``: a scaled
    format, whose row scale goes to ``scale_dst``). ``tests/layers/test_kv_quant_triton.py`` holds the
    stored bytes and scales to the torch path's (``layers/kv_quant.py``) bit for bit, so the
    arithmetic below is pinned by those tests, not restated here.

    Two things only a kernel needs: divisions are IEEE (``div_rn``), since Triton's ``/`` may
    round differently on a GPU and a code one step off near a rounding boundary would differ from
    the torch path's; and the rounding to the stored type happens in fp32 before the cast (the
    ``_round_*`` helpers), since a cast to int8 truncates and Triton's CPU interpreter casts fp32
    to fp8 and bf16 without rounding to nearest-even — the cast then re-encodes an exact value.
    """
    stored = dst.dtype.element_ty           # known when the kernel is compiled: static branches
    x = x.to(tl.float32)
    if QMAX > 0:
        peak = tl.max(tl.abs(x), axis=0)
        step = tl.maximum(tl.math.div_rn(peak, QMAX), 1.1754943508222875e-38)
        step = tl.where(peak > 0, step, 1.0)
        tl.store(scale_dst, step)
        x = tl.math.div_rn(x, step)
    if stored == tl.int8:
        x = tl.minimum(tl.maximum(_round_half_even(x), -QMAX), QMAX)
    elif stored == tl.float8e4nv:
        x = _round_to_e4m3(x)
    elif stored == tl.bfloat16:
        x = _round_to_bf16(x)
    tl.store(dst, x.to(stored))


@triton.jit
def _round_half_even(x):
    """``torch.round``: to the nearest integer, ties to even (libdevice's ``rint`` does this on a
    GPU, but the interpreter has no libdevice). ``x - floor(x)`` is exact for |x| < 2**23."""
    f = tl.floor(x)
    frac = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)


@triton.jit
def _round_to_e4m3(x):
    """x (|x| <= 448) rounded to the nearest float8 e4m3 value, ties to even, kept in fp32.

    e4m3 has 3 mantissa bits, so around ``2**e`` its values are ``2**(e - 3)`` apart; below its
    smallest normal exponent, -6, the subnormals keep the spacing ``2**-9``. The exponent comes
    from the float's bits (a log2 could land on the wrong side of a power of two), and dividing by
    a power of two, rounding, multiplying back are all exact in fp32."""
    biased_exp = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased_exp = tl.maximum(biased_exp, 127 - 6)
    step = ((biased_exp - 3) << 23).to(tl.float32, bitcast=True)    # 2 ** (exponent - 3)
    return _round_half_even(tl.math.div_rn(x, step)) * step


@triton.jit
def _round_to_bf16(x):
    """x rounded to the nearest bfloat16, ties to even, kept in fp32: bf16 is fp32's top 16 bits,
    so add half of the dropped part (minus one, plus the kept last bit: ties go to even) and
    clear it."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536              # -65536 == 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


# ----------------------------------------------------------------------------------------------
# 2. decode: one new query token per sequence attends to its whole context.
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attend_blocks(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, ctx,
                   first_block, end_block, kv_head, stride_cb, stride_ct, stride_ch, stride_sb,
                   stride_st, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   GROUP_P: tl.constexpr, SCALED: tl.constexpr):
    """Online softmax of a query group over blocks ``first_block .. end_block - 1`` of a sequence.

    ``q`` is ``[GROUP_P, HEAD_DIM]`` fp32, already multiplied by ``scale * log2(e)``. Returns the
    running max ``m`` and sum ``l`` (both ``[GROUP_P]``) and the unnormalised output ``acc``.
    SCALED: every row loaded is ``stored * scale`` (rung 9); ``q . (k * s) = (q . k) * s``, so the
    K scale multiplies the block's BLOCK_SIZE scores and the V scale its weights, not every element.
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
        if SCALED:                                  # one scale per row: [BLOCK_SIZE]
            s_offs = block * stride_sb + tok * stride_st + kv_head
            k_s = tl.load(k_scale_ptr + s_offs, mask=valid, other=0.0)
            v_s = tl.load(v_scale_ptr + s_offs, mask=valid, other=0.0)
        # Scores [GROUP_P, BLOCK_SIZE]. A broadcast multiply-and-sum, not tl.dot: tensor cores need
        # at least 16 rows and a GQA group has 1-8 query heads. Decode is bound by memory traffic
        # (each K/V element is used GROUP times), so the arithmetic units are not the bottleneck.
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        if SCALED:
            s = s * k_s[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        # Online softmax step. Every block in the range holds >= 1 valid token, so m_new is finite
        # from the first block on, and exp2(-inf - m_new) = 0 wipes the empty initial state.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)                  # rescales what was accumulated so far
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if SCALED:                                  # after l: the softmax weights stay as they are
            p = p * v_s[None, :]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    return m, l, acc


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
                        ctx_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, qk_scale,
                        blocks_per_split, stride_qb, stride_qh, stride_ob, stride_oh, stride_tb,
                        stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, SCALED: tl.constexpr):
    """Grid (batch, kv head, split). One program serves all GROUP query heads of one KV head.

    Why group: with GQA, H // num_kv_heads query heads read the same K/V. Giving each query head
    its own program would load every K/V block GROUP times; here it is loaded once.

    SPLIT=False (grid's last dimension is 1): the program walks the whole context and writes the
    final output. SPLIT=True (flash-decoding): the program walks only its slice of
    ``blocks_per_split`` blocks and writes the partial ``(m, l, acc)``; ``reduce_splits_kernel``
    then merges the slices. Splitting matters when batch * kv_heads programs are too few to occupy
    the GPU: a batch of 1 with 8 KV heads would otherwise run on 8 of 132 SMs.

    SCALED (rung 9): the pools hold int8/fp8 rows and ``k_scale_ptr``/``v_scale_ptr`` their
    scales; ``_attend_blocks`` applies them, and the partials of a split are already in real units,
    so ``reduce_splits_kernel`` is the same for every pool.
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

    m, l, acc = _attend_blocks(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                               table_ptr + b * stride_tb, ctx, first_block, end_block, kv_head,
                               stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                               BLOCK_SIZE, HEAD_DIM, GROUP_P, SCALED)
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
def paged_extend_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
                        cu_q_ptr, ctx_ptr, out_ptr, qk_scale, stride_qt, stride_qh, stride_ot,
                        stride_oh, stride_tb, stride_cb, stride_ct, stride_ch, stride_sb,
                        stride_st, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr, SCALED: tl.constexpr):
    """Grid (sequence, query tile, query head): BLOCK_M queries against BLOCK_N-key tiles.

    Unlike decode, a tile of queries reuses every key it loads BLOCK_M times, so this is compute
    work worth tl.dot (tensor cores). A key tile of BLOCK_N tokens may span several cache blocks
    (block_size 8 is below tl.dot's minimum of 16) or part of one, so each key looks up its own
    physical block: ``block_table[pos // block_size]``.

    A narrower pool (rung 9) is read in q's type (int8 and fp8 values are exact in any of them)
    and, SCALED, its scales fold into the scores and the weights, as in ``_attend_blocks``.
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
        k, v = k.to(q.dtype), v.to(q.dtype)    # tl.dot takes one type; no-ops for a plain pool
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale    # [BLOCK_M, BLOCK_N]
        if SCALED:
            s_offs = block * stride_sb + (pos_k % BLOCK_SIZE) * stride_st + kv_head
            s = s * tl.load(k_scale_ptr + s_offs, mask=k_ok, other=0.0)[None, :]
        # Key 0 is visible to every row (padding rows past q_len included, their pos_q >= 0), so
        # no row is ever fully masked and m stays finite after the first tile: no NaNs.
        s = tl.where((pos_k[None, :] <= pos_q[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if SCALED:
            p = p * tl.load(v_scale_ptr + s_offs, mask=k_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# --- the way in: launch.py checks shapes and picks the grid; these hand it the kernels above ---
def store_kv(*args, **kwargs) -> None:
    return launch.store_kv(store_kv_kernel, *args, **kwargs)


def paged_decode(*args, **kwargs):
    return launch.paged_decode(paged_decode_kernel, reduce_splits_kernel, *args, **kwargs)


def paged_extend(*args, **kwargs):
    return launch.paged_extend(paged_extend_kernel, *args, **kwargs)
