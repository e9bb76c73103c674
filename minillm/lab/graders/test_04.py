"""Exercise 04 — paged attention in torch: ``TorchAttention.write_kv``, ``gather`` and ``decode``.

K/V are scattered into a pool through shuffled block tables, then read back: decode must equal
plain attention over each sequence's own contiguous K/V (grouped-query heads included), and the
paged engine using this attention must give Hugging Face's tokens.
"""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.core.attention.reference import TorchAttention
from minillm.lab.reference import assert_greedy_match, hf_greedy, random_prompts


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D], k/v [L, KVH, D] of one sequence -> [H, D], written out without any library call."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [L, H, D]
    scores = torch.einsum("hd,lhd->hl", q, k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=5), block_size=st.sampled_from([1, 4, 8]),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), seed=st.integers(0, 999))
def test_decode_through_block_tables_equals_plain_attention(lens, block_size, kv_heads, group, seed):
    gen = torch.Generator().manual_seed(seed)
    d, heads = 8, kv_heads * group
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)                   # blocks anywhere in the pool
    tables = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    attn = TorchAttention()
    ks = [torch.randn(n, kv_heads, d, generator=gen) for n in lens]
    vs = [torch.randn(n, kv_heads, d, generator=gen) for n in lens]
    slots = torch.cat([torch.tensor([int(tables[b, i // block_size]) * block_size + i % block_size
                                     for i in range(n)]) for b, n in enumerate(lens)])
    attn.write_kv(torch.cat(ks), torch.cat(vs), k_cache, v_cache, slots)
    for b, n in enumerate(lens):
        got = attn.gather(k_cache, tables[b:b + 1], n)[0]
        assert torch.equal(got, ks[b]), \
            f"gather of sequence {b} ({n} tokens) must return exactly the K rows written for it"
    q = torch.randn(len(lens), heads, d, generator=gen)
    scale = 0.61 * d ** -0.5          # not SDPA's default: decode must use the scale it is given
    out = attn.decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale)
    assert tuple(out.shape) == (len(lens), heads, d)
    for b, n in enumerate(lens):
        want = plain_attention(q[b], ks[b], vs[b], scale)
        assert torch.allclose(out[b], want, atol=1e-5), (
            f"sequence {b}: decode differs from attention over its own {n} tokens with scale "
            f"{scale:.4f} (reading other sequences' slots, past context_lens, or another "
            "scale?)")


def test_paged_engine_with_this_attention_equals_hf(tiny):
    prompts = random_prompts(4, seed=51, lo=3, hi=30)
    # the torch backend: the one whose decode you wrote (the CPU default is the C++ kernel)
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=64, attention_backend="torch")
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert_greedy_match(o.token_ids, hf_greedy(tiny, p, 8), label=f"request {i}")
