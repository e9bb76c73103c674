"""Bad input gets a clear error, and never takes the other requests down."""
from __future__ import annotations

import dataclasses
import re

import pytest

from minillm import LLM, FinishReason, Request, SamplingParams
from conftest import engine_params
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
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        LLM(tiny, engine="paged", block_size=0)
    with pytest.raises(ValueError, match="smaller than one block"):
        LLM(tiny, engine="paged", kv_cache_bytes=10)


@pytest.mark.parametrize("engine", engine_params(ENGINES))
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


# --- every field checked by type and value, at construction -----------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    ({"stop_token_ids": None}, "stop_token_ids must be a list of token ids, got None"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids, got 5"),
    ({"stop_token_ids": "ab"}, "stop_token_ids must be a list of token ids, got 'ab'"),
    ({"stop_token_ids": [1, "x"]}, "stop_token_ids[] must be an integer, got 'x'"),
    ({"temperature": "0.5"}, "temperature must be a number, got '0.5'"),
    ({"temperature": None}, "temperature must be a number, got None"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5"),
    ({"max_tokens": True}, "max_tokens must be an integer, got True"),
    ({"seed": "7"}, "seed must be an integer, got '7'"),
    ({"ignore_eos": "yes"}, "ignore_eos must be True or False, got 'yes'"),
    ({"n": 2, "beam_width": 2}, "choose parallel sampling (n) or beam search"),
    ({"beam_width": 2, "temperature": 0.7}, "beam_width=2 needs temperature=0"),
])
def test_sampling_params_checked_by_type(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"), ({"stop_token_ids": [1, "x"]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"n": 2, "beam_width": 2}, "n"),
    ({"logprobs": 3, "beam_width": 2}, "logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 9, "max_tokens": 4},
                                                        "min_tokens"),
    ({"logit_bias": {5: 200}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"), ({"min_p": 0.5, "beam_width": 2}, "min_p"),
    ({"min_tokens": 2, "structured_outputs": {"choice": ["a"]}}, "min_tokens"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a"]}, "beam_width": 2}, "structured_outputs"),
])
def test_every_refusal_names_its_field_as_data(kwargs, field):
    """``FieldError.field``: what the server names as its error's ``param``, never read out of
    the message ("min_tokens=2 cannot be combined..." once gave the param "min_tokens=2")."""
    from minillm.checks import FieldError
    with pytest.raises(FieldError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field, e.value


def test_numpy_and_tiny_values_are_normalized(tiny):
    import numpy as np
    p = SamplingParams(max_tokens=np.int64(4), top_k=np.int32(3), stop_token_ids=(np.int64(9),),
                       temperature=1e-38)
    assert (p.max_tokens, p.top_k, p.stop_token_ids) == (4, 3, (9,)) and type(p.max_tokens) is int
    assert p.greedy, "a temperature too small to divide by behaves as greedy"
    llm = LLM(tiny, engine="paged")
    tiny_t = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1e-38, seed=1))
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6))
    assert tiny_t[0].token_ids == greedy[0].token_ids


def test_sampling_params_cannot_be_broken_after_checking(tiny):
    """A checked SamplingParams stays valid: assigning a field raises at once (before any engine
    sees it); ``dataclasses.replace`` checks the new value like the constructor does."""
    p = SamplingParams(max_tokens=3, stop_token_ids=[5])
    with pytest.raises(dataclasses.FrozenInstanceError, match="stop_token_ids"):
        p.stop_token_ids = None
    with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids, got None"):
        dataclasses.replace(p, stop_token_ids=None)
    outs = LLM(tiny, engine="paged").generate([[1, 2, 3]], dataclasses.replace(p, seed=1))
    assert outs[0].error is None and len(outs[0].token_ids) <= 3


def test_params_as_dict_and_request_fields(tiny):
    llm = LLM(tiny, engine="paged")
    out = llm.generate([[5, 6, 7]], {"max_tokens": 3, "ignore_eos": True})[0]
    assert len(out.token_ids) == 3
    with pytest.raises(ValueError, match="unknown SamplingParams field\\(s\\): 'max_new_tokens'"):
        llm.generate([[5, 6, 7]], {"max_new_tokens": 3})
    with pytest.raises(ValueError, match="params must be a SamplingParams .* got int"):
        llm.generate([[5, 6, 7]], 3)
    with pytest.raises(ValueError, match="priority must be an integer, got 'high'"):
        Request([5, 6], priority="high")
    with pytest.raises(ValueError, match="priority must be an integer, got None"):
        Request([5, 6], priority=None)
    with pytest.raises(ValueError, match="arrival_offset_s must be >= 0"):
        Request([5, 6], arrival_offset_s=-1)


@pytest.mark.parametrize("kwargs,words", [
    ({"kv_cache_bytes": 0}, "kv_cache_bytes must be an integer >= 1, got 0"),
    ({"kv_cache_bytes": 1.5e9}, "kv_cache_bytes must be an integer, got 1500000000.0"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be an integer >= 1, got 0"),
    ({"num_blocks": 0}, "num_blocks must be an integer >= 1, got 0"),
    ({"block_size": "16"}, "block_size must be an integer, got '16'"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
    ({"policy": "lifo"}, "unknown policy 'lifo'"),
])
def test_paged_engine_options_checked(tiny, kwargs, words):
    with pytest.raises(ValueError, match=words):
        LLM(tiny, engine="paged", **kwargs)


@pytest.mark.parametrize("engine,kwargs,words", [
    ("static", {"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ("dynamic", {"max_num_seqs": "8"}, "max_num_seqs must be an integer, got '8'"),
])
def test_contiguous_engine_options_checked(tiny, engine, kwargs, words):
    with pytest.raises(ValueError, match=words):
        LLM(tiny, engine=engine, **kwargs)


def test_priority_sort_never_bricks_the_engine(tiny):
    """Priorities are ints by construction, so the scheduler's sort cannot fail mid-run."""
    llm = LLM(tiny, engine="paged", policy="priority")
    reqs = llm.make_requests([[5, 6], [7, 8]], SamplingParams(max_tokens=2))
    reqs[1].priority = -1
    outs = llm.run(reqs).outputs
    assert all(o.finish_reason == FinishReason.LENGTH for o in outs)


@pytest.mark.parametrize("engine", ["dynamic", "paged"])
def test_bad_prompts_get_their_own_errors(tiny, engine):
    import numpy as np
    prompts = ["fine", "bad \udcff text", [{"content": "no role"}], [{"role": "user"}],
               {"prompt_token_ids": "hello"}, {"prompt": 5}, [5, 6.0, 7], [5, "x"],
               [5, np.int64(6), 7], {"prompt": "a", "messages": []}, 3.5]
    outs = LLM(tiny, engine=engine).generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(outs) == len(prompts)
    ok = [o for o in outs if o.error is None]
    assert [o.request_id for o in ok] == [outs[0].request_id, outs[8].request_id]
    assert all(len(o.token_ids) == 2 for o in ok)
    errors = [o.error for o in outs]
    assert "prompt is not valid Unicode" in errors[1]
    assert "messages[0] must be a dict with string 'role' and 'content'" in errors[2]
    assert "messages[0] must be a dict" in errors[3]
    assert "'prompt_token_ids' must be a list of token ids, got str" in errors[4]
    assert "'prompt' must be a string, got int" in errors[5]
    assert "prompt token ids must be integers, got 6.0 (float)" in errors[6]
    assert "prompt token ids must be integers, got 'x' (str)" in errors[7]
    assert "needs exactly one of" in errors[9]
    assert "cannot understand a prompt of type float" in errors[10]


# --- every integer a user can send has a range ---------------------------------------------------
def _make(field: str, value):
    """The object that checks ``field``: a Request for priority, else SamplingParams."""
    if field == "priority":
        return Request([5, 6], priority=value)
    if field == "stop_token_ids[]":
        return SamplingParams(stop_token_ids=[value])
    return SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "seed", "n", "beam_width",
                                   "stop_token_ids[]", "priority"])
def test_integer_fields_are_bounded(field):
    """Each end of its range is accepted (numpy ints too); one past it, a 400-digit number and a
    5,000-digit one (beyond what Python will print) are a ValueError naming field and value."""
    import numpy as np

    from minillm.checks import FIELD_RANGES
    lo, hi = FIELD_RANGES[field]
    for ok in (lo, hi, np.int64(hi)):
        _make(field, ok)
    where = re.escape(f"{field} must be an integer in [{lo}, {hi}], got ")
    for bad, shown in [(lo - 1, str(lo - 1)), (hi + 1, str(hi + 1)),
                       (int("9" * 400), "an integer of 400 digits"),
                       (-(10 ** 5000), "a negative integer of about 5001 digits")]:
        with pytest.raises(ValueError, match=where + re.escape(shown) + "$"):
            _make(field, bad)


def test_a_huge_priority_fails_its_own_request_under_score(tiny):
    """A priority assigned after the Request was made (as the CLI and the server do) is checked
    again on admission: that request gets an error naming it; the others get the tokens an FCFS
    run gives them."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    want = LLM(tiny, engine="paged").generate(prompts, params)
    llm = LLM(tiny, engine="paged", policy="score")
    reqs = llm.make_requests(prompts, params)
    reqs[1].priority = int("9" * 400)
    outs = llm.run(reqs).outputs
    assert outs[1].finish_reason == FinishReason.ERROR
    assert "priority must be an integer in [-2147483648, 2147483647], got an integer of 400 " \
           "digits" in outs[1].error
    assert [o.token_ids for o in (outs[0], outs[2])] == [want[0].token_ids, want[2].token_ids]
    assert all(o.error is None for o in (outs[0], outs[2]))


def test_jsonl_line_with_a_huge_number_fails_alone(tmp_path, tiny):
    """``generate --policy score``: the line with a 400-digit priority and the one with a
    400-digit max_tokens get errors naming the field; the other lines their outputs; exit 1
    (some lines failed, cmd_generate's report)."""
    import json

    from minillm.__main__ import main

    huge = "9" * 400
    lines = ['{"id": "a", "prompt_token_ids": [5, 6, 7]}',
             '{"id": "b", "prompt_token_ids": [8, 9], "priority": %s}' % huge,
             '{"id": "c", "prompt_token_ids": [8, 9], "max_tokens": %s}' % huge,
             '{"id": "d", "prompt_token_ids": [10, 11, 12], "priority": -3}']
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    code = main(["generate", "--engine", "paged", "--policy", "score", "--model", "tiny-llama",
                 "--prompts", str(src), "--out", str(dst), "--max-tokens", "4", "--quiet",
                 "--dtype", "float32"])        # the `tiny` fixture's dtype: tokens compared
    rows = {row["id"]: row for row in map(json.loads, dst.read_text().splitlines())}
    assert code == 1
    assert rows["b"]["error"].startswith("line 2: priority must be an integer in "
                                         "[-2147483648, 2147483647], got an integer of 400 digits")
    assert rows["c"]["error"].startswith("line 3: max_tokens must be an integer in "
                                         "[1, 2147483647], got an integer of 400 digits")
    want = LLM(tiny, engine="paged").generate([[5, 6, 7], [10, 11, 12]],
                                              SamplingParams(max_tokens=4))
    assert [rows[k].get("token_ids") for k in "ad"] == [w.token_ids for w in want]
