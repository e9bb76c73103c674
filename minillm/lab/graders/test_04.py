"""Exercise 04 — paged attention in torch: ``TorchAttention.write_kv``, ``gather`` and ``decode``.

K/V are scattered into a pool through shuffled block tables, then read back: decode must equal
plain attention over each sequence's own contiguous K/V (grouped-query heads included), and the
paged engine using this attention must give Hugging Face's tokens.

Every call of your functions happens in your process (``probe_*``, the ``student`` fixture): the
inputs are made here, the rows your ``gather`` reads and your ``decode``'s output come back, and
they are judged here against attention written out from its definition.
"""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.layers.attention.reference import TorchAttention
from minillm.lab.reference import assert_greedy_match, hf_greedy, random_prompts


OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)


def probe_paged(cache_shape: tuple, ks: list, vs: list, slots, tables, lens: list, q,
                scale: float) -> tuple:
    """Write every sequence's K/V through ``slots``, gather each back, decode ``q``."""
    k_cache, v_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    attn = TorchAttention()
    attn.write_kv(torch.cat(ks), torch.cat(vs), k_cache, v_cache, slots)
    gathered = [attn.gather(k_cache, tables[b:b + 1], n)[0] for b, n in enumerate(lens)]
    out = attn.decode(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale)
    return gathered, out


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, D], k/v [L, KVH, D] of one sequence -> [H, D], written out without any library call."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [L, H, D]
    scores = torch.einsum("hd,lhd->hl", q, k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=5), block_size=st.sampled_from([1, 4, 8]),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), seed=st.integers(0, 999))
def test_decode_through_block_tables_equals_plain_attention(student, lens, block_size, kv_heads,
                                                            group, seed):
    gen = torch.Generator().manual_seed(seed)
    d, heads = 8, kv_heads * group
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)                   # blocks anywhere in the pool
    tables = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    ks = [torch.randn(n, kv_heads, d, generator=gen) for n in lens]
    vs = [torch.randn(n, kv_heads, d, generator=gen) for n in lens]
    slots = torch.cat([torch.tensor([int(tables[b, i // block_size]) * block_size + i % block_size
                                     for i in range(n)]) for b, n in enumerate(lens)])
    q = torch.randn(len(lens), heads, d, generator=gen)
    scale = 0.61 * d ** -0.5          # not SDPA's default: decode must use the scale it is given
    gathered, out = student.run(probe_paged, (num_blocks, block_size, kv_heads, d), ks, vs, slots,
                                tables, lens, q, scale)
    for b, n in enumerate(lens):
        got = gathered[b]
        assert isinstance(got, torch.Tensor) and got.shape == ks[b].shape and \
            torch.equal(got, ks[b]), \
            f"gather of sequence {b} ({n} tokens) must return exactly the K rows written for it"
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (len(lens), heads, d), \
        f"decode returns [batch, heads, head_dim] = {(len(lens), heads, d)}"
    for b, n in enumerate(lens):
        want = plain_attention(q[b], ks[b], vs[b], scale)
        assert torch.allclose(out[b], want, atol=1e-5), (
            f"sequence {b}: decode differs from attention over its own {n} tokens with scale "
            f"{scale:.4f} (reading other sequences' slots, past context_lens, or another "
            "scale?)")


def probe_paged_engine(prompts: list) -> list:
    from minillm import load_model
    tiny = load_model("tiny-llama", dtype=torch.float32)
    # the torch backend: the one whose decode you wrote (the CPU default is the C++ kernel)
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=64, attention_backend="torch")
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    return [[int(t) for t in o.token_ids] for o in outs]


def test_paged_engine_with_this_attention_equals_hf(student, tiny):
    prompts = random_prompts(4, seed=51, lo=3, hi=30)
    outs = student.run(probe_paged_engine, prompts)
    assert len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} prompts"
    for i, (p, tokens) in enumerate(zip(prompts, outs)):
        assert_greedy_match(tokens, hf_greedy(tiny, p, 8), label=f"request {i}")
