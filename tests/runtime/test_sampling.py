"""Sampling: top-k / top-p filtering against a direct reference, and per-request seeds that make
a request's samples independent of what it was batched with."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from minillm import LLM, SamplingParams
from minillm.sampling import filtered_probs, first_max, sample_one


def reference_filter(logits, temperature, top_k, top_p):
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        if top_k and rank >= top_k:
            break
        if kept and top_p < 1.0 and mass >= top_p:
            break
        kept.append(i)
        mass += float(probs[i])
    return set(kept)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.5), (3, 0.9), (1, 1.0)])
def test_filter_matches_reference(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    probs, ids = filtered_probs(logits, 0.7, top_k, top_p)
    assert set(ids.tolist()) == reference_filter(logits, 0.7, top_k, top_p)
    assert abs(float(probs.sum()) - 1) < 1e-5


def test_inverse_cdf_sampling_frequencies():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    counts = [0, 0, 0]
    for i in range(3000):
        counts[sample_one(logits, 1.0, 0, 1.0, (i + 0.5) / 3000)] += 1
    assert [round(c / 3000, 2) for c in counts] == [0.5, 0.3, 0.2]


@pytest.mark.parametrize("engine", ["dynamic", "paged"])
def test_seeded_sample_is_independent_of_batch(tiny, engine):
    target = random_prompts(1, seed=9)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    llm = LLM(tiny, engine=engine)
    alone = llm.generate([target], params)[0].token_ids
    others = random_prompts(6, seed=10)
    mixed = llm.generate(others + [target], [SamplingParams(max_tokens=15, temperature=0.8, seed=i)
                                             for i in range(6)] + [params])
    assert mixed[-1].token_ids == alone
    small = LLM(tiny, engine="paged", num_blocks=-(-(len(target) + 20) // 4) + 2, block_size=4)
    again = small.run(small.make_requests(
        others[:3] + [target], [SamplingParams(max_tokens=15, temperature=0.8, seed=1)] * 3 + [params]))
    assert again.metrics.num_preemptions > 0
    assert again.outputs[-1].token_ids == alone, "preemption must not change a seeded sample"


def test_parallel_samples_share_prompt_blocks(tiny):
    """n = 4: four different samples, prompt blocks shared (fewer blocks than 4 requests)."""
    prompt = random_prompts(1, seed=11, lo=64, hi=64)[0]
    p4 = SamplingParams(max_tokens=8, n=4, temperature=1.0, seed=5, ignore_eos=True)
    llm = LLM(tiny, engine="paged", block_size=8)
    res = llm.run(llm.make_requests([prompt], p4))
    samples = res.outputs[0].samples
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    one = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    res4 = llm.run(llm.make_requests([prompt] * 4, [one] * 4))
    peak = lambda r: max(s.kv.allocated for s in r.steps)
    assert peak(res) < 0.7 * peak(res4)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_beam_search_matches_hf(tiny):
    llm = LLM(tiny, engine="paged", block_size=4)
    for width in (2, 3):
        for prompt in random_prompts(3, seed=12, lo=3, hi=20):
            ids = torch.tensor([prompt])
            ref = tiny.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                         num_beams=width, num_return_sequences=width,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
            out = llm.generate([prompt], SamplingParams(max_tokens=8, beam_width=width,
                                                        ignore_eos=True))[0]
            assert out.samples == [r[ids.shape[1]:].tolist() for r in ref]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_max_is_argmax_ties_and_nan_included(dtype):
    """Greedy rows take ``max(dim=-1)``'s indices (faster on the CPU): the first of equal maxima
    and a NaN's place, as ``argmax`` gives them."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g).to(dtype)
    logits[1, [3, 500, 999]] = 50.0                   # ties: the first wins
    logits[2] = 0.0                                   # every entry tied
    logits[3, 700] = float("nan")
    logits[4, [10, 20]] = float("inf")
    assert first_max(logits) == logits.argmax(dim=-1).tolist()
    assert first_max(logits)[1] == 3 and first_max(logits)[2] == 0
    assert first_max(logits[:0]) == []
