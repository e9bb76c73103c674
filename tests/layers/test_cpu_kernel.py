"""The C++ paged decode kernel (rung 3's decode for the CPU) against the torch reference and
textbook attention, and the paged engine's tokens with it. Same traps as the Triton tests
(kvtools.PagedKV): shuffled blocks from a larger pool, NaN wherever no sequence lives."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvtools import SCALE, PagedKV, decode_lens, dense_attention, rel_err
from minillm import LLM
from minillm.engines import get_attention_backend
from minillm.layers.attention import cpp as cpu_attention
from minillm.layers.attention.reference import AttentionMetadata, TorchAttention
from minillm.layers.attention.cpp import CppAttention, cpp_available

pytestmark = pytest.mark.skipif(not cpp_available(), reason="the C++ kernel cannot be built here: "
                                f"{cpu_attention.kernel_error()}")


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (6, 2), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decode_matches_reference_and_dense(block_size, heads, kv_heads, dtype):
    torch.manual_seed(block_size + heads)
    kv = PagedKV(decode_lens(block_size), block_size, kv_heads)
    q = torch.randn(len(kv.lens), heads, kv.k_ref.shape[-1])
    ref = TorchAttention().decode(q, kv.k_ref, kv.v_ref, kv.tables, kv.context_lens, SCALE)
    out = CppAttention().decode(q.to(dtype), kv.k_nan.to(dtype), kv.v_nan.to(dtype), kv.tables,
                                kv.context_lens, SCALE)
    dense = torch.cat([dense_attention(q[b:b + 1], kv.k_dense[b], kv.v_dense[b], [n - 1])
                       for b, n in enumerate(kv.lens)])
    assert out.dtype == dtype
    assert rel_err(out, ref) <= 1e-5 and rel_err(out, dense) <= 1e-5
    if dtype == torch.float64:
        assert rel_err(out, dense) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (9, 3)])
def test_16_bit_decode_is_fp32_attention_of_the_same_numbers(heads, kv_heads, dtype):
    """A bf16 / fp16 model's decode (--dtype): computed in fp32 on the 16-bit query and pool
    rows (widened as read, never copied), then rounded once to the query's type."""
    torch.manual_seed(heads)
    kv = PagedKV(decode_lens(16), 16, kv_heads)
    q = torch.randn(len(kv.lens), heads, kv.k_ref.shape[-1]).to(dtype)
    k, v = kv.k_nan.to(dtype), kv.v_nan.to(dtype)
    out = CppAttention().decode(q, k, v, kv.tables, kv.context_lens, SCALE)
    want = TorchAttention().decode(q.float(), kv.k_ref.to(dtype).float(),
                                   kv.v_ref.to(dtype).float(), kv.tables, kv.context_lens, SCALE)
    assert out.dtype == dtype
    assert rel_err(out.float(), want) <= 2 ** -7      # one 16-bit rounding of the result


WIDE = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16), (torch.float16, torch.float16)]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("q_dtype,pool_dtype", WIDE)
def test_wide_heads_equal_textbook_attention(head_dim, block_size, q_dtype, pool_dtype):
    """Head dims 64 and 128 (SmolLM2's, Llama's) take the kernel's vector path where the CPU has
    AVX-512: 16-token tiles over any block size, masked tails, one vector exp, and a bf16
    query's dot products in bf16 on a bf16 pool. Lengths sit on both sides of every tile and
    block edge; the pool is NaN wherever no sequence lives."""
    torch.manual_seed(head_dim + block_size)
    lens = [1, 15, 16, 17, 31, 33, 48, 100]
    kv = PagedKV(lens, block_size, 3, head_dim=head_dim)
    q = torch.randn(len(lens), 9, head_dim).to(q_dtype)
    out = CppAttention().kernel.paged_decode(q, kv.k_nan.to(pool_dtype), kv.v_nan.to(pool_dtype),
                                             None, None, kv.tables, kv.context_lens, SCALE)
    dense = torch.cat([dense_attention(q[b:b + 1].float(), kv.k_dense[b].to(pool_dtype).float(),
                                       kv.v_dense[b].to(pool_dtype).float(), [n - 1])
                       for b, n in enumerate(lens)])
    assert out.dtype == q_dtype
    # fp32 arithmetic on the same numbers; a 16-bit result is rounded once more
    assert rel_err(out.float(), dense) <= (1e-5 if q_dtype == torch.float32 else 2 ** -7)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (6, 2), (8, 2), (10, 2), (16, 2)])
def test_bf16_query_heads_in_groups_of_any_size(head_dim, heads, kv_heads):
    """A bf16 query on a bf16 pool sums V for up to 4 query heads at once (2 at head_dim 128),
    two tokens per instruction with the weights rounded to bf16: groups of 1-8 heads split into
    those chunks, odd tiles pair their last token with a weight of zero, and the pool past every
    context is NaN."""
    torch.manual_seed(heads + head_dim)
    lens = [1, 2, 15, 17, 33, 64]
    kv = PagedKV(lens, 16, kv_heads, head_dim=head_dim)
    q = torch.randn(len(lens), heads, head_dim).to(torch.bfloat16)
    out = CppAttention().kernel.paged_decode(q, kv.k_nan.to(torch.bfloat16),
                                             kv.v_nan.to(torch.bfloat16), None, None, kv.tables,
                                             kv.context_lens, SCALE)
    dense = torch.cat([dense_attention(q[b:b + 1].float(), kv.k_dense[b].bfloat16().float(),
                                       kv.v_dense[b].bfloat16().float(), [n - 1])
                       for b, n in enumerate(lens)])
    assert rel_err(out.float(), dense) <= 2 ** -7


def _extend_here() -> bool:
    return cpp_available() and CppAttention().extends_bf16


# (block size, query heads, KV heads): groups of 1, 3 and 16 query heads (the most it takes)
EXTEND_SHAPES = [(1, 9, 3), (8, 3, 3), (16, 9, 3), (16, 32, 2), (32, 9, 3)]


@pytest.mark.skipif(not _extend_here(), reason="paged_extend needs AVX512-BF16")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size,heads,kv_heads", EXTEND_SHAPES)
def test_bf16_prefill_equals_textbook_attention(head_dim, block_size, heads, kv_heads):
    """A bf16 model's prefill in the kernel (paged_extend): whole prompts and chunks after a
    cached prefix, each query seeing the keys up to its own position, read through shuffled
    blocks of a pool that is NaN wherever no sequence lives. Lengths sit on both sides of tile
    and block edges; fp32 arithmetic on the bf16 numbers, the result rounded once."""
    torch.manual_seed(head_dim + block_size + heads)
    ctx = [1, 16, 17, 40, 33, 70]
    q_lens = [1, 16, 5, 40, 1, 35]           # 5, 1 and 35: chunks after a cached prefix
    kv = PagedKV(ctx, block_size, kv_heads, head_dim=head_dim)
    q = torch.randn(sum(q_lens), heads, head_dim).to(torch.bfloat16)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    out = CppAttention().kernel.paged_extend(q, kv.k_nan.to(torch.bfloat16),
                                             kv.v_nan.to(torch.bfloat16), kv.tables, cu,
                                             kv.context_lens, SCALE)
    dense = torch.cat([dense_attention(q[cu[s]:cu[s + 1]].float(),
                                       kv.k_dense[s].bfloat16().float(),
                                       kv.v_dense[s].bfloat16().float(), list(range(n - m, n)))
                       for s, (n, m) in enumerate(zip(ctx, q_lens))])
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), dense) <= 2 ** -7


@pytest.mark.skipif(not _extend_here(), reason="paged_extend needs AVX512-BF16")
def test_bf16_prefill_is_the_kernels_and_bad_input_an_error():
    """CppAttention.extend takes the kernel for a bf16 query on a bf16 pool (within one bf16
    rounding of the torch reference), the torch path otherwise; a table that lists a block
    outside the pool, or queries past their context, are errors, not reads."""
    kv = PagedKV([20, 9], 16, 3, head_dim=64)
    q = torch.randn(29, 9, kv.k_ref.shape[-1]).to(torch.bfloat16)
    k, v = kv.k_ref.to(torch.bfloat16), kv.v_ref.to(torch.bfloat16)
    slots = torch.cat(kv.slots)
    meta = AttentionMetadata(slot_mapping=slots, num_decode=0, decode_block_tables=kv.tables[:0],
                             decode_context_lens=kv.context_lens[:0],
                             prefill_block_tables=kv.tables,
                             prefill_cu_seqlens_q=torch.tensor([0, 20, 29], dtype=torch.int32),
                             prefill_context_lens=kv.context_lens, prefill_q_lens=[20, 9],
                             prefill_ctx_lens=[20, 9])
    k_new, v_new = k.view(-1, 3, k.shape[-1])[slots], v.view(-1, 3, v.shape[-1])[slots]
    ref = TorchAttention().extend(q.float(), k_new.float(), v_new.float(), k.float(), v.float(),
                                  meta, SCALE)
    calls = []

    class Counting:                   # the kernel, counting its prefill calls
        def __getattr__(self, name):
            if name == "paged_extend":
                calls.append(name)
            return getattr(CppAttention().kernel, name)
    backend = CppAttention()
    backend.kernel = Counting()
    out = backend.extend(q, k_new, v_new, k, v, meta, SCALE)
    assert calls and rel_err(out.float(), ref) <= 2 ** -7
    backend.extend(q.float(), k_new.float(), v_new.float(), k.float(), v.float(), meta, SCALE)
    assert len(calls) == 1, "an fp32 model prefills through torch"
    bad = kv.tables.clone()
    bad[1, 0] = k.shape[0] + 3
    with pytest.raises(RuntimeError, match="not in the pool"):
        backend.kernel.paged_extend(q, k, v, bad, meta.prefill_cu_seqlens_q, kv.context_lens, SCALE)
    with pytest.raises(RuntimeError, match="do not fit its table"):
        backend.kernel.paged_extend(q, k, v, kv.tables, torch.tensor([0, 2, 29], dtype=torch.int32),
                                    kv.context_lens, SCALE)


def test_bad_tables_are_errors_not_reads_outside_the_pool():
    kv = PagedKV([5, 9], 4, 2)
    q = torch.randn(2, 4, kv.k_ref.shape[-1])
    kernel = CppAttention().kernel
    bad = kv.tables.clone()
    bad[1, 0] = kv.k_ref.shape[0] + 7
    with pytest.raises(RuntimeError, match="not in the pool"):
        kernel.paged_decode(q, kv.k_ref, kv.v_ref, None, None, bad, kv.context_lens, SCALE)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        kernel.paged_decode(q, kv.k_ref, kv.v_ref, None, None, kv.tables, kv.context_lens * 10,
                            SCALE)
    with pytest.raises(RuntimeError, match="do not match"):      # 4 query heads, 2 KV heads
        kernel.paged_decode(q[:, :3], kv.k_ref, kv.v_ref, None, None, kv.tables, kv.context_lens,
                            SCALE)
    with pytest.raises(RuntimeError, match="scales for both pools or neither"):
        kernel.paged_decode(q, kv.k_ref, kv.v_ref, kv.k_ref[..., 0], None, kv.tables,
                            kv.context_lens, SCALE)
    with pytest.raises(RuntimeError, match="one scale per stored row"):
        kernel.paged_decode(q, kv.k_ref, kv.v_ref, kv.k_ref[..., :2], kv.v_ref[..., :2],
                            kv.tables, kv.context_lens, SCALE)


def test_engine_tokens_equal_torch_backend(tiny):
    """Greedy and seeded sampling, n > 1 and beams, a tight pool (preemption) and prefix caching:
    the same tokens as the torch reference; the pool is back to full after."""
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 33, 26)]
    params = [{"max_tokens": 24, "ignore_eos": True},
              {"max_tokens": 20, "temperature": 0.8, "seed": 3, "ignore_eos": True},
              {"max_tokens": 12, "n": 3, "temperature": 1.0, "seed": 5, "ignore_eos": True},
              {"max_tokens": 10, "beam_width": 2, "ignore_eos": True}]
    outs = {}
    for backend in ("torch", "cpp"):
        llm = LLM(tiny, engine="paged", block_size=4, num_blocks=40, max_num_seqs=4,
                  enable_prefix_caching=True, attention_backend=backend)
        assert llm.engine.backend.name == backend
        outs[backend] = [[o.samples for o in llm.generate(prompts, p)] for p in params]
        assert llm.engine.block_manager.num_free_blocks == 40
        assert llm.engine.num_preemptions > 0
    assert outs["cpp"] == outs["torch"]


def test_default_backend_on_cpu_and_fallback(monkeypatch):
    assert get_attention_backend(None, torch.device("cpu")).name == "cpp"
    # where the kernel cannot be built, the default is the torch reference and "cpp" still works
    monkeypatch.setattr(cpu_attention, "_state", {"error": "no compiler (test)"})
    assert get_attention_backend(None, torch.device("cpu")).name == "torch"
    backend = get_attention_backend("cpp", torch.device("cpu"))
    assert backend.kernel is None
    kv = PagedKV([3, 7], 4, 1)
    q = torch.randn(2, 2, kv.k_ref.shape[-1])
    ref = TorchAttention().decode(q, kv.k_ref, kv.v_ref, kv.tables, kv.context_lens, SCALE)
    assert torch.equal(backend.decode(q, kv.k_ref, kv.v_ref, kv.tables, kv.context_lens, SCALE), ref)
