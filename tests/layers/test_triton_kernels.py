"""Rung 4's Triton kernels against rung 3's torch reference, and the reference against dense math.

Runs on CPU through the Triton interpreter (kept small so the file takes well under two minutes
on two cores); on a CUDA machine the same tests would compile the kernels natively.

Traps for wrong kernels:
* block tables point at shuffled physical blocks from a pool larger than needed, padded with -1;
* every slot of the kernel's KV pools that is not part of some sequence's context is NaN (the
  reference reads a clean copy: its gather pulls in whole blocks and multiplies masked positions
  by zero, and 0 * NaN is NaN), so a kernel that reads past a context or the wrong block fails;
* output buffers are passed in filled with NaN, so an element the kernel forgets to write fails.
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

from kvtools import HEAD_DIM, NAN, SCALE, PagedKV, decode_lens, dense_attention, rel_err  # noqa: E402,F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4
GQA = [(3, 3), (6, 2)]                 # (query heads, kv heads): group sizes 1 and 3
BLOCK_SIZES = [8, 16, 32]


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_store_kv(block_size):
    torch.manual_seed(0)
    nkv, nblocks, T = 2, 7, 20
    shape = (nblocks, block_size, nkv, HEAD_DIM)
    k_cache, v_cache = torch.full(shape, NAN, device=DEVICE), torch.full(shape, NAN, device=DEVICE)
    slots = torch.randperm(nblocks * block_size)[:T].to(DEVICE)        # scattered, any order
    k = torch.randn(T, nkv, HEAD_DIM, device=DEVICE)
    v = torch.randn(T, nkv, HEAD_DIM, device=DEVICE)
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    ref_k, ref_v = torch.full(shape, NAN, device=DEVICE), torch.full(shape, NAN, device=DEVICE)
    TorchAttention.write_kv(k, v, ref_k, ref_v, slots)
    for got, ref, x in ((k_cache, ref_k, k), (v_cache, ref_v, v)):
        flat = got.view(-1, nkv, HEAD_DIM)
        assert torch.equal(flat[slots], x)                            # written slots exact
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert flat[untouched].isnan().all()                          # nothing else touched
        assert torch.equal(got.nan_to_num(7.0), ref.nan_to_num(7.0))  # same as the reference


def test_store_kv_skips_padding_slots():
    torch.manual_seed(0)
    shape = (3, 8, 1, HEAD_DIM)
    k_cache, v_cache = torch.full(shape, NAN, device=DEVICE), torch.full(shape, NAN, device=DEVICE)
    k, v = torch.randn(2, 1, HEAD_DIM, device=DEVICE), torch.randn(2, 1, HEAD_DIM, device=DEVICE)
    kernels.store_kv(k, v, k_cache, v_cache, torch.tensor([5, -1], device=DEVICE))
    assert torch.equal(k_cache.view(-1, 1, HEAD_DIM)[5], k[0])
    assert k_cache.isnan().sum() == k_cache.numel() - HEAD_DIM


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_reference_decode_matches_dense(block_size, heads, kv_heads):
    torch.manual_seed(1)
    kv = PagedKV(decode_lens(block_size), block_size, kv_heads)
    q = torch.randn(len(kv.lens), heads, HEAD_DIM)
    ref = TorchAttention().decode(q, kv.k_ref, kv.v_ref, kv.tables, kv.context_lens, SCALE)
    dense = torch.cat([dense_attention(q[b:b + 1], kv.k_dense[b], kv.v_dense[b], [n - 1])
                       for b, n in enumerate(kv.lens)])
    assert rel_err(ref, dense) <= TOL


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("num_splits", [1, 3, 7])    # 1: single pass; 7: one block per split
def test_paged_decode(block_size, heads, kv_heads, num_splits):
    torch.manual_seed(2)
    kv = PagedKV(decode_lens(block_size), block_size, kv_heads).to(DEVICE)
    q = torch.randn(len(kv.lens), heads, HEAD_DIM, device=DEVICE)
    ref = TorchAttention().decode(q, kv.k_ref, kv.v_ref, kv.tables, kv.context_lens, SCALE)
    out = kernels.paged_decode(q, kv.k_nan, kv.v_nan, kv.tables, kv.context_lens, SCALE,
                               num_splits=num_splits, out=torch.full_like(q, NAN))
    assert rel_err(out, ref) <= TOL


def test_paged_decode_auto_split_and_single_token():
    torch.manual_seed(3)
    kv = PagedKV([1], 16, 2, extra_cols=0).to(DEVICE)                # one sequence, one token
    q = torch.randn(1, 4, HEAD_DIM, device=DEVICE)
    out = kernels.paged_decode(q, kv.k_nan, kv.v_nan, kv.tables, kv.context_lens, SCALE)
    v = kv.v_dense[0][0].to(DEVICE)                                  # softmax over one key is 1
    assert rel_err(out, v.repeat_interleave(2, dim=0)[None]) <= TOL
    # a long table for a batch of one: the automatic choice splits (4 nominal "SMs" on CPU)
    kv = PagedKV([40 * 16 + 5], 16, 1).to(DEVICE)
    assert kernels.choose_num_splits(1, kv.tables.shape[1] * 16, torch.device(DEVICE)) > 1
    q = torch.randn(1, 2, HEAD_DIM, device=DEVICE)
    ref = TorchAttention().decode(q, kv.k_ref, kv.v_ref, kv.tables, kv.context_lens, SCALE)
    out = kernels.paged_decode(q, kv.k_nan, kv.v_nan, kv.tables, kv.context_lens, SCALE,
                               out=torch.full_like(q, NAN))
    assert rel_err(out, ref) <= TOL


def extend_case(block_size: int) -> list[tuple[int, int]]:
    """(cached, new) tokens per sequence: fresh prompts, prefix hits, chunks, q_len 1, > 16 rows."""
    bs = block_size
    return [(0, 1), (0, bs), (bs, 1), (3, bs + 1), (2 * bs - 3, 3), (bs + 1, 2 * bs - 1)]


def extend_inputs(block_size: int, heads: int, kv_heads: int):
    case = extend_case(block_size)
    kv = PagedKV([c + n for c, n in case], block_size, kv_heads)
    q_lens = [n for _, n in case]
    q = torch.randn(sum(q_lens), heads, HEAD_DIM)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    k_new = torch.cat([kv.k_dense[s][c:] for s, (c, _) in enumerate(case)])
    v_new = torch.cat([kv.v_dense[s][c:] for s, (c, _) in enumerate(case)])
    meta = AttentionMetadata(
        slot_mapping=torch.cat([kv.slots[s][c:] for s, (c, _) in enumerate(case)]),
        num_decode=0, decode_block_tables=torch.empty(0, 1, dtype=torch.int32),
        decode_context_lens=torch.empty(0, dtype=torch.int32), prefill_block_tables=kv.tables,
        prefill_cu_seqlens_q=cu, prefill_context_lens=kv.context_lens, prefill_q_lens=q_lens,
        prefill_ctx_lens=kv.lens)
    return case, kv, q, k_new, v_new, meta


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_reference_extend_matches_dense(block_size, heads, kv_heads):
    torch.manual_seed(4)
    case, kv, q, k_new, v_new, meta = extend_inputs(block_size, heads, kv_heads)
    ref = TorchAttention().extend(q, k_new, v_new, kv.k_ref, kv.v_ref, meta, SCALE)
    dense, start = [], 0
    for s, (c, n) in enumerate(case):
        dense.append(dense_attention(q[start:start + n], kv.k_dense[s], kv.v_dense[s],
                                     list(range(c, c + n))))
        start += n
    assert rel_err(ref, torch.cat(dense)) <= TOL


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kv_heads", GQA)
def test_paged_extend(block_size, heads, kv_heads):
    torch.manual_seed(5)
    case, kv, q, k_new, v_new, meta = extend_inputs(block_size, heads, kv_heads)
    ref = TorchAttention().extend(q, k_new, v_new, kv.k_ref, kv.v_ref, meta, SCALE)
    kv.to(DEVICE)
    q = q.to(DEVICE)
    out = kernels.paged_extend(q, kv.k_nan, kv.v_nan, kv.tables.to(DEVICE),
                               meta.prefill_cu_seqlens_q.to(DEVICE), kv.context_lens, SCALE,
                               out=torch.full_like(q, NAN))
    assert rel_err(out.cpu(), ref) <= TOL


@pytest.mark.parametrize("block_size", [8, 32])
def test_backend_full_step(block_size):
    """A mixed step through ``paged_attention``: write K/V, 3 decodes, then 2 prefill chunks."""
    torch.manual_seed(6)
    heads, kv_heads, bs = 6, 2, block_size
    case = [(bs - 1, 1), (bs, 1), (2 * bs, 1), (0, bs + 2), (bs + 3, 5)]   # (cached, new)
    kv = PagedKV([c + n for c, n in case], bs, kv_heads)
    slots = torch.cat([kv.slots[s][c:] for s, (c, _) in enumerate(case)])
    k_new = torch.cat([kv.k_dense[s][c:] for s, (c, _) in enumerate(case)])
    v_new = torch.cat([kv.v_dense[s][c:] for s, (c, _) in enumerate(case)])
    q = torch.randn(k_new.shape[0], heads, HEAD_DIM)
    q_lens, ctx = [n for _, n in case[3:]], [c + n for c, n in case[3:]]
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode=3, decode_block_tables=kv.tables[:3],
        decode_context_lens=kv.context_lens[:3], prefill_block_tables=kv.tables[3:],
        prefill_cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
        prefill_context_lens=kv.context_lens[3:], prefill_q_lens=q_lens, prefill_ctx_lens=ctx)
    ref = paged_attention(TorchAttention(), q, k_new, v_new, kv.k_ref, kv.v_ref, meta, SCALE)
    # The Triton pools start as NaN except the cached prefixes: the new tokens must be written.
    k_pool, v_pool = kv.k_nan.view(-1, kv_heads, HEAD_DIM), kv.v_nan.view(-1, kv_heads, HEAD_DIM)
    k_pool[slots], v_pool[slots] = NAN, NAN
    to = (lambda x: x.to(DEVICE))
    meta_dev = AttentionMetadata(**{f: to(getattr(meta, f)) if torch.is_tensor(getattr(meta, f))
                                    else getattr(meta, f) for f in meta.__dataclass_fields__})
    backend = TritonAttention()
    assert backend.name == "triton"
    out = paged_attention(backend, to(q), to(k_new), to(v_new), to(kv.k_nan), to(kv.v_nan),
                          meta_dev, SCALE)
    assert rel_err(out.cpu(), ref) <= TOL
