"""Every engine's greedy output equals Hugging Face ``generate`` run on each request alone."""
from __future__ import annotations

import random

import pytest

from conftest import assert_greedy_match, hf_greedy, random_prompts
from minillm import LLM, FinishReason, SamplingParams

ENGINE_CONFIGS = {
    "naive-nocache": {},
    "naive": {},
    "static": {"batch_size": 3},
    "dynamic": {"max_num_seqs": 3},
    "paged": {},                                                      # onednn linears on CPU
    "paged-torch-linear": {"linear_backend": "torch"},                # F.linear
    "paged-tiny-pool": {"num_blocks": 12, "block_size": 8},          # forces preemption
    "paged-chunked": {"max_num_batched_tokens": 7},                   # forces chunked prefill
    "paged-prefix": {"enable_prefix_caching": True, "block_size": 4, "max_num_seqs": 1},
    "paged-priority": {"policy": "priority", "max_num_seqs": 2},
}


def engine_of(config: str) -> str:
    return "paged" if config.startswith("paged") else config


@pytest.fixture(scope="module")
def tiny_case(tiny):
    rng = random.Random(1)
    prompts = random_prompts(10, seed=1)
    prompts[3] = prompts[0][:5] + prompts[3]    # some shared prefixes for the prefix cache
    prompts[4] = prompts[0] + prompts[4][:3]
    lengths = [rng.randint(1, 24) for _ in prompts]
    refs = [hf_greedy(tiny, p, k) for p, k in zip(prompts, lengths)]
    return prompts, lengths, refs


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_tiny_llama_matches_hf(tiny, tiny_case, config):
    prompts, lengths, refs = tiny_case
    llm = LLM(tiny, engine=engine_of(config), **ENGINE_CONFIGS[config])
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths]
    result = llm.run(llm.make_requests(prompts, params))
    for i, (out, ref) in enumerate(zip(result.outputs, refs)):
        assert out.finish_reason == FinishReason.LENGTH
        assert_greedy_match(out.token_ids, ref, label=f"{config} request {i}")
        assert out.ttft_s is not None and 0 <= out.ttft_s <= out.latency_s
    assert result.metrics.output_tokens == sum(lengths)
    if config == "paged-tiny-pool":
        assert result.metrics.num_preemptions > 0, "the tiny pool should have forced preemption"
    if config == "paged-chunked":
        assert max(s.num_prefill_tokens for s in result.steps) <= 7
    if config == "paged-prefix":
        assert result.metrics.prefill_tokens_computed < sum(len(p) for p in prompts)
    if engine_of(config) == "paged":   # every block back in the pool
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "List three fruits that are red.",
]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["naive", "static", "dynamic", "paged"])
def test_smollm2_chat_matches_hf(smol, engine, hf_ref):
    llm = LLM(smol, engine=engine)
    prompts = [[{"role": "user", "content": c}] for c in CHATS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24))
    for c, out, ids in zip(CHATS, outs, [llm.encode(p) for p in prompts]):
        ref = hf_ref(smol, ids, 24, stop_at_eos=True)
        assert_greedy_match(out.token_ids, ref, label=f"{engine}: {c}")
        assert out.text.strip(), "a chat answer should not be empty"


def test_eos_stops_request(tiny):
    """Without ignore_eos, a request ends at its EOS token with finish reason stop."""
    llm = LLM(tiny, engine="paged")
    prompts = random_prompts(40, seed=5)
    outs = llm.generate(prompts, SamplingParams(max_tokens=60, stop_token_ids=[7, 8, 9, 10, 11]))
    stopped = [o for o in outs if o.finish_reason == FinishReason.STOP]
    assert stopped, "some of 40 random requests should hit a stop token within 60 tokens"
    for o in stopped:
        assert o.token_ids[-1] in (7, 8, 9, 10, 11)
        assert not set(o.token_ids[:-1]) & {7, 8, 9, 10, 11}


def test_naive_nocache_and_cache_cost(tiny):
    """Rung 0's lesson: without a cache each step re-runs the whole sequence (O(n^2) tokens)."""
    prompt, n = random_prompts(1, seed=2, lo=10, hi=10)[0], 20
    computed = {}
    for engine in ("naive-nocache", "naive"):
        llm = LLM(tiny, engine=engine)
        res = llm.run(llm.make_requests([prompt], SamplingParams(max_tokens=n, ignore_eos=True)))
        steps = res.steps
        computed[engine] = sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps)
    assert computed["naive"] == 10 + (n - 1)
    assert computed["naive-nocache"] == sum(10 + i for i in range(n))
