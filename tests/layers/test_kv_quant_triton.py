"""Rung 9's narrow KV cache through rung 4's Triton kernels: quantize on write, widen on read.

The store kernel must write what ``QuantizedPool.index_copy_`` (``kv_quant.quantize``) writes, and
decode/extend must equal *dequantize the pool, then attend* with the torch reference. Runs on CPU
through the Triton interpreter (small shapes: the file takes under a minute on two cores).

Tolerances:
* store: float formats (fp8, float16, bfloat16) byte for byte; int8 codes equal, except that a
  code may be one step off where ``x / scale`` lies within 1e-4 of a .5 tie (fp32 division may
  round either way there); scales within 1e-6 relative. Under the interpreter all are exact.
* attention: fp32 compute, max abs error 1e-4 (the kernels fold the scale into scores and
  weights, the reference multiplies every element: the same sums in another order); an fp16 model
  against an fp16 reference 1e-2, bf16 3e-2 (the kernels accumulate in fp32, the reference's
  softmax and products round to 16 bits; bf16 runs on a GPU only, see BF16_DOT).

Traps, as in test_triton_kernels.py: every pool row no sequence owns is poisoned -- its scale NaN
(int8 has no NaN, and the interpreter reads fp8's NaN byte as 480), its data NaN where the type
has one -- so a kernel reading a row it must not read returns NaN; outputs start as NaN. The
reference reads a clean copy (NaN zeroed: it gathers whole blocks and multiplies masked positions
by zero, and 0 * NaN is NaN).
"""
from __future__ import annotations

import os

import torch  # does not import triton

if not torch.cuda.is_available():                 # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from minillm.layers.attention.reference import (  # noqa: E402
    AttentionMetadata, TorchAttention, paged_attention)
# Importing TritonAttention calls require_triton(): where the kernels cannot run, collecting this
# file fails here, saying why (tests/layers/test_triton_optional.py checks that logic).
from minillm.layers.attention.triton import TritonAttention  # noqa: E402
from minillm.layers.attention.triton import kernels  # noqa: E402
from minillm.layers.kv_quant import FORMATS, QuantizedPool, dequantize  # noqa: E402

from kvtools import HEAD_DIM, NAN, SCALE, PagedKV, decode_lens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMTS = ["int8", "fp8", "float16", "bfloat16"]
BLOCK_SIZES = [1, 4, 16]
GQA = [(1, 1), (3, 1), (2, 2), (6, 2)]     # (query heads, kv heads): kv heads 1, 2; groups 1, 3
ATOL = 1e-4


def raw(t: torch.Tensor) -> torch.Tensor:
    """The stored bytes as integers, so NaN rows compare equal and fp8 compares at all."""
    if not t.is_floating_point():
        return t
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def poisoned_pool(shape: tuple[int, ...], fmt: str, dtype=torch.float32) -> QuantizedPool:
    """A pool in ``fmt`` whose every row is poison: NaN scales, NaN data where the type has one."""
    pool = QuantizedPool.zeros(shape, FORMATS[fmt], dtype, DEVICE)
    if pool.data.is_floating_point():
        raw(pool.data).copy_(raw(torch.full(shape, NAN, device=DEVICE).to(pool.data.dtype)))
    else:
        pool.data.fill_(1)
    if pool.scale is not None:
        pool.scale.fill_(NAN)
    return pool


def clean(pool: QuantizedPool) -> torch.Tensor:
    """The reference's copy of a pool: all of it dequantized (a test may; the kernels never do),
    the poison zeroed."""
    return dequantize(pool.data, pool.scale, pool.dtype).nan_to_num(0.0)


class QuantKV:
    """kvtools.PagedKV's sequences (shuffled blocks, -1 padded tables), stored in ``fmt``."""

    def __init__(self, lens: list[int], block_size: int, kv_heads: int, fmt: str):
        self.kv = kv = PagedKV(lens, block_size, kv_heads)
        self.k, self.v = poisoned_pool(kv.k_nan.shape, fmt), poisoned_pool(kv.v_nan.shape, fmt)
        for s in range(len(lens)):      # written by the reference writer: decode/extend alone
            TorchAttention.write_kv(kv.k_dense[s].to(DEVICE), kv.v_dense[s].to(DEVICE), self.k,
                                    self.v, kv.slots[s].to(DEVICE))
        self.k_ref, self.v_ref = clean(self.k), clean(self.v)
        self.tables, self.context_lens = kv.tables.to(DEVICE), kv.context_lens.to(DEVICE)


# ----------------------------------------------------------------------------------------------
def ties_row(fmt: str) -> torch.Tensor:
    """A row whose scale is 1 and whose other values fall exactly halfway between two stored
    values: rounding must go to the even one, as torch's does."""
    if fmt == "int8":
        vals = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5]
    elif fmt == "fp8":        # e4m3: 16, 18 (step 2 in [16, 32)); subnormals step 2**-9
        vals = [448.0, 17.0, 19.0, -17.0, 2 ** -10, 3 * 2 ** -10, 240.0 + 8.0]
    elif fmt == "bfloat16":   # 7 mantissa bits: 1 + 2**-8 is halfway between 1 and 1 + 2**-7
        vals = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.0]
    else:                     # float16: 10 mantissa bits
        vals = [1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -11), 3.0]
    row = torch.zeros(HEAD_DIM)
    row[:len(vals)] = torch.tensor(vals)
    return row


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_store_matches_index_copy(fmt, block_size, kv_heads):
    torch.manual_seed(0)
    nblocks = 40 // block_size + 2
    shape = (nblocks, block_size, kv_heads, HEAD_DIM)
    T = min(20, nblocks * block_size)
    slots = torch.randperm(nblocks * block_size)[:T].to(DEVICE)        # scattered, any order
    # rows of very different sizes (each gets its own scale), an all-zero row (scale 1), ties
    k = torch.randn(T, kv_heads, HEAD_DIM) * torch.logspace(-3, 2, T)[:, None, None]
    v = torch.randn(T, kv_heads, HEAD_DIM)
    k[1, -1] = 0.0
    v[2, 0] = ties_row(fmt)
    k, v = k.to(DEVICE), v.to(DEVICE)
    slots_padded = torch.cat([slots, torch.tensor([-1], device=DEVICE)])   # -1: a padding token
    k_pad = torch.cat([k, torch.randn(1, kv_heads, HEAD_DIM, device=DEVICE)])
    v_pad = torch.cat([v, torch.randn(1, kv_heads, HEAD_DIM, device=DEVICE)])
    got_k, got_v = poisoned_pool(shape, fmt), poisoned_pool(shape, fmt)
    TritonAttention.write_kv(k_pad, v_pad, got_k, got_v, slots_padded)
    ref_k, ref_v = poisoned_pool(shape, fmt), poisoned_pool(shape, fmt)
    TorchAttention.write_kv(k, v, ref_k, ref_v, slots)                 # QuantizedPool.index_copy_
    for got, ref, x in ((got_k, ref_k, k), (got_v, ref_v, v)):
        if ref.scale is not None:
            assert torch.allclose(got.scale, ref.scale, rtol=1e-6, atol=0, equal_nan=True)
        if fmt == "int8":
            diff = (got.data.int() - ref.data.int()).abs().view(-1, kv_heads, HEAD_DIM)
            y = x / ref.scale.view(-1, kv_heads)[slots][..., None]    # what was rounded
            may_differ = torch.zeros_like(diff, dtype=torch.bool)
            may_differ[slots] = ((y.abs() - y.abs().floor()) - 0.5).abs() < 1e-4
            assert diff.max() <= 1 and not diff[~may_differ].any()
        else:
            assert torch.equal(raw(got.data), raw(ref.data))
    # the ties row's scale is 1, so x / scale is exact: its ties must round to even, no slack
    assert torch.equal(raw(got_v.data.view(-1, kv_heads, HEAD_DIM)[slots[2], 0]),
                       raw(ref_v.data.view(-1, kv_heads, HEAD_DIM)[slots[2], 0]))


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_decode_reads_narrow_rows(fmt, block_size, heads, kv_heads):
    torch.manual_seed(1)
    kv = QuantKV(decode_lens(block_size), block_size, kv_heads, fmt)
    q = torch.randn(len(kv.kv.lens), heads, HEAD_DIM, device=DEVICE)
    ref = TorchAttention().decode(q, kv.k_ref, kv.v_ref, kv.tables, kv.context_lens, SCALE)
    for splits in (1, 3):           # single pass, and flash-decoding + reduce_splits
        out = kernels.paged_decode(q, kv.k.data, kv.v.data, kv.tables, kv.context_lens, SCALE,
                                   num_splits=splits, out=torch.full_like(q, NAN),
                                   k_scale=kv.k.scale, v_scale=kv.v.scale)
        assert (out - ref).abs().max() <= ATOL, splits            # NaN fails too
    out = TritonAttention().decode(q, kv.k, kv.v, kv.tables, kv.context_lens, SCALE)
    assert (out - ref).abs().max() <= ATOL


def extend_meta(case: list[tuple[int, int]], kv: QuantKV) -> tuple[list[int], AttentionMetadata]:
    q_lens = [n for _, n in case]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([kv.kv.slots[s][c:] for s, (c, _) in enumerate(case)]).to(DEVICE),
        num_decode=0, decode_block_tables=torch.empty(0, 1, dtype=torch.int32, device=DEVICE),
        decode_context_lens=torch.empty(0, dtype=torch.int32, device=DEVICE),
        prefill_block_tables=kv.tables,
        prefill_cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(DEVICE, torch.int32),
        prefill_context_lens=kv.context_lens, prefill_q_lens=q_lens, prefill_ctx_lens=kv.kv.lens)
    return q_lens, meta


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_extend_reads_narrow_rows(fmt, block_size, heads, kv_heads):
    torch.manual_seed(2)
    bs = block_size      # (cached, new): fresh prompts, prefix hits, chunks, 17 rows (two tiles)
    case = [(0, 1), (0, bs + 2), (bs, 1), (3, bs + 1), (2 * bs + 1, 3), (bs + 1, 17)]
    kv = QuantKV([c + n for c, n in case], bs, kv_heads, fmt)
    q_lens, meta = extend_meta(case, kv)
    q = torch.randn(sum(q_lens), heads, HEAD_DIM, device=DEVICE)
    # the reference's own K/V of a fresh prompt must be the stored ones too: read from its copy
    k_new = kv.k_ref.view(-1, kv_heads, HEAD_DIM)[meta.slot_mapping]
    v_new = kv.v_ref.view(-1, kv_heads, HEAD_DIM)[meta.slot_mapping]
    ref = TorchAttention().extend(q, k_new, v_new, kv.k_ref, kv.v_ref, meta, SCALE)
    out = kernels.paged_extend(q, kv.k.data, kv.v.data, kv.tables, meta.prefill_cu_seqlens_q,
                               kv.context_lens, SCALE, out=torch.full_like(q, NAN),
                               k_scale=kv.k.scale, v_scale=kv.v.scale)
    assert (out - ref).abs().max() <= ATOL
    out = TritonAttention().extend(q, k_new, v_new, kv.k, kv.v, meta, SCALE)
    assert (out - ref).abs().max() <= ATOL


# ----------------------------------------------------------------------------------------------
INTERPRETED = not torch.cuda.is_available()
BF16_DOT = pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter keeps bf16 as raw "
                              "16-bit integers, and its tl.dot multiplies those (the extend "
                              "kernel; rung 4's unquantized path too)")


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype,atol", [(torch.float32, ATOL), (torch.float16, 1e-2),
                                        pytest.param(torch.bfloat16, 3e-2, marks=BF16_DOT)])
def test_backend_full_step(fmt, dtype, atol):
    """A mixed step through ``paged_attention``: write (quantize), 3 decodes, 2 prefill chunks,
    against dequantize-then-attend on what the Triton store wrote (also checked against the
    reference writer's rows)."""
    torch.manual_seed(3)
    heads, kv_heads, bs = 6, 2, 4
    case = [(bs - 1, 1), (bs, 1), (2 * bs, 1), (0, bs + 2), (bs + 3, 5)]   # (cached, new)
    kv = PagedKV([c + n for c, n in case], bs, kv_heads)
    dense = [(kv.k_dense[s].to(DEVICE, dtype), kv.v_dense[s].to(DEVICE, dtype),
              kv.slots[s].to(DEVICE)) for s in range(len(case))]
    # Cached prefixes written by the reference writer; the new tokens' rows start poisoned.
    k, v = poisoned_pool(kv.k_nan.shape, fmt, dtype), poisoned_pool(kv.v_nan.shape, fmt, dtype)
    for (c, _), (ks, vs, slots) in zip(case, dense):
        TorchAttention.write_kv(ks[:c], vs[:c], k, v, slots[:c])
    k_new = torch.cat([ks[c:] for (c, _), (ks, _, _) in zip(case, dense)])
    v_new = torch.cat([vs[c:] for (c, _), (_, vs, _) in zip(case, dense)])
    new_slots = torch.cat([slots[c:] for (c, _), (_, _, slots) in zip(case, dense)])
    q = torch.randn(k_new.shape[0], heads, HEAD_DIM, device=DEVICE, dtype=dtype)
    tables, lens = kv.tables.to(DEVICE), kv.context_lens.to(DEVICE)
    q_lens, ctx = [n for _, n in case[3:]], [c + n for c, n in case[3:]]
    meta = AttentionMetadata(
        slot_mapping=new_slots, num_decode=3, decode_block_tables=tables[:3],
        decode_context_lens=lens[:3], prefill_block_tables=tables[3:],
        prefill_cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(DEVICE, torch.int32),
        prefill_context_lens=lens[3:], prefill_q_lens=q_lens, prefill_ctx_lens=ctx)
    out = paged_attention(TritonAttention(), q, k_new, v_new, k, v, meta, SCALE)

    ref_k, ref_v = poisoned_pool(k.shape, fmt, dtype), poisoned_pool(v.shape, fmt, dtype)
    for ks, vs, slots in dense:
        TorchAttention.write_kv(ks, vs, ref_k, ref_v, slots)
    for got, want in ((k, ref_k), (v, ref_v)):        # int8: one code off at a tie, at most
        assert (got.data.float() - want.data.float()).nan_to_num(0).abs().max() <= (
            1 if fmt == "int8" else 0)
        assert want.scale is None or torch.allclose(got.scale, want.scale, rtol=1e-6,
                                                    equal_nan=True)
    k_ref, v_ref = clean(k), clean(v)
    k_new_ref = k_ref.view(-1, kv_heads, HEAD_DIM)[new_slots]
    v_new_ref = v_ref.view(-1, kv_heads, HEAD_DIM)[new_slots]
    ref = paged_attention(TorchAttention(), q, k_new_ref, v_new_ref, k_ref, v_ref, meta, SCALE)
    assert (out.float() - ref.float()).abs().max() <= atol


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU's path only")
def test_triton_backend_runs_after_load_model_without_triton_interpret_set():
    """A user's fresh process: ``load_model`` imports transformers, which imports triton; the
    interpreter must already be chosen then (minillm/__init__.py), or triton's own functions
    (``tl.max``) fail inside the kernels. Tokens equal the torch reference's, int8 cache too."""
    import subprocess
    import sys
    code = ("from minillm import LLM, SamplingParams, load_model\n"
            "m = load_model('tiny-llama')\n"
            "for be in ('torch', 'triton'):\n"
            "    llm = LLM(m, engine='paged', attention_backend=be, kv_cache_dtype='int8',\n"
            "              block_size=4, num_blocks=32)\n"
            "    print(llm.generate(['hello world'], SamplingParams(max_tokens=6),\n"
            "                       progress=False)[0].token_ids)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    torch_line, triton_line = done.stdout.strip().splitlines()[-2:]
    assert torch_line == triton_line
