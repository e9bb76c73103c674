"""Bad input gets a clear error, and never takes the other requests down."""
from __future__ import annotations

import pytest

from minillm import LLM, FinishReason, SamplingParams
from minillm.engines import ENGINES


@pytest.mark.parametrize("kwargs,words", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"n": 0}, "n must"), ({"beam_width": 0}, "beam_width")])
def test_sampling_params_rejected(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_unknown_engine_and_model(tiny):
    with pytest.raises(ValueError, match="unknown engine 'warp'"):
        LLM(tiny, engine="warp")
    with pytest.raises(ValueError, match="unknown model 'gpt-9'"):
        LLM("gpt-9", engine="naive")
    with pytest.raises(ValueError, match="bad option for engine 'static'"):
        LLM(tiny, engine="static", block_size=4)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        LLM(tiny, engine="paged", block_size=0)
    with pytest.raises(ValueError, match="smaller than one block"):
        LLM(tiny, engine="paged", kv_cache_bytes=10)


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_requests_get_errors_others_complete(tiny, engine):
    too_long = [5] * tiny.max_model_len
    prompts = ["good one", "", [9999], too_long, "another good one"]
    outs = LLM(tiny, engine=engine).generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    reasons = [o.finish_reason for o in outs]
    assert reasons[0] == reasons[4] == FinishReason.LENGTH
    assert len(outs[0].token_ids) == len(outs[4].token_ids) == 4
    assert "empty prompt" in outs[1].error
    assert "outside the vocabulary" in outs[2].error
    assert "longer than the model's context" in outs[3].error
    assert reasons[1:4] == [FinishReason.ERROR] * 3


def test_paged_rejects_request_larger_than_pool(tiny):
    llm = LLM(tiny, engine="paged", num_blocks=4, block_size=4)
    outs = llm.generate([[5] * 10, [5] * 30], SamplingParams(max_tokens=4, ignore_eos=True))
    assert outs[0].finish_reason == FinishReason.LENGTH
    assert outs[1].finish_reason == FinishReason.ERROR and "could never run" in outs[1].error


def test_n_and_beams_need_paged(tiny):
    out = LLM(tiny, engine="dynamic").generate(["hi"], SamplingParams(n=2, temperature=1))[0]
    assert out.finish_reason == FinishReason.ERROR and "'paged' engine" in out.error


def test_paged_rejects_parallel_request_larger_than_pool(tiny):
    """n samples each need their own blocks for the output: a request that fits only as n = 1
    is rejected up front instead of stalling the scheduler."""
    llm = LLM(tiny, engine="paged", block_size=64, num_blocks=4)
    params = SamplingParams(max_tokens=71, n=3, temperature=0.8, seed=0, ignore_eos=True)
    out = llm.generate([[5] * 47], params)[0]
    assert out.finish_reason == FinishReason.ERROR and "could never run" in out.error
    ok = llm.generate([[5] * 47], SamplingParams(max_tokens=71, ignore_eos=True))[0]
    assert ok.finish_reason == FinishReason.LENGTH
