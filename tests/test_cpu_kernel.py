"""The C++ paged decode kernel (rung 3's decode for the CPU) against the torch reference and
textbook attention, and the paged engine's tokens with it. Same traps as the Triton tests
(kvtools.PagedKV): shuffled blocks from a larger pool, NaN wherever no sequence lives."""
from __future__ import annotations

import pytest
import torch

from kvtools import SCALE, PagedKV, decode_lens, dense_attention, rel_err
from minillm import LLM
from minillm.engines import get_attention_backend
from minillm.core.attention import cpp as cpu_attention
from minillm.core.attention.reference import TorchAttention
from minillm.core.attention.cpp import CppAttention, cpp_available

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
