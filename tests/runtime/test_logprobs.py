"""Log-probabilities: ``SamplingParams(logprobs=k, prompt_logprobs=k)`` offline, and the
server's completions ``logprobs``/``echo`` and chat ``logprobs``/``top_logprobs`` through the official
``openai`` client. Every number is checked against Hugging Face's ``log_softmax`` of its own fp32
logits for the same token ids: generated tokens, prompt tokens, under chunked prefill, n > 1,
preemption and a prefix-cache hit."""
from __future__ import annotations

import openai
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.request import Request, RequestError
from serve_util import running_server

TOL = 1e-4


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row j is the distribution of token j + 1 (Hugging Face, fp32)."""
    with torch.no_grad():
        return torch.log_softmax(model.hf_model(torch.tensor([ids], device=model.device)).logits[0].float(), -1)


def check_entries(ref: torch.Tensor, ids: list[int], entries: list, first: int, k: int) -> None:
    """``entries[i]`` is token ``first + i`` of ``ids``: its logprob and its top k equal HF's."""
    for i, entry in enumerate(entries):
        j = first + i
        row = ref[j - 1]
        assert ids[j] in entry and len(entry) in (k, k + 1), (j, entry)
        assert abs(entry[ids[j]] - row[ids[j]].item()) < TOL, j
        top = row.topk(k)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < TOL, (j, t)


def check_output(model, prompt: list[int], out, k: int, pk: int | None) -> None:
    assert len(out.sample_logprobs) == len(out.samples)
    for tokens, entries in zip(out.samples, out.sample_logprobs):
        ids = prompt + tokens
        ref = hf_logprobs(model, ids)
        assert len(entries) == len(tokens)
        check_entries(ref, ids, entries, len(prompt), k)
    if pk is not None:
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        check_entries(hf_logprobs(model, prompt), prompt, out.prompt_logprobs[1:], 1, pk)


PROMPT = list(range(5, 42))          # 37 tokens: several chunks and blocks


@pytest.mark.parametrize("case,options,params", [
    ("chunked prefill", dict(max_num_batched_tokens=8, block_size=4),
     dict(max_tokens=6, logprobs=3, prompt_logprobs=2)),
    ("n > 1 sampled", dict(block_size=4), dict(max_tokens=5, logprobs=2, prompt_logprobs=1, n=3,
                                               temperature=1.0, seed=7)),
    ("greedy, top 0", dict(), dict(max_tokens=4, logprobs=0, prompt_logprobs=0)),
])
def test_logprobs_equal_hugging_face(tiny, case, options, params):
    llm = LLM(tiny, engine="paged", **options)
    out = llm.generate([PROMPT], SamplingParams(ignore_eos=True, **params))[0]
    check_output(tiny, PROMPT, out, params["logprobs"], params["prompt_logprobs"])


def test_logprobs_survive_preemption(tiny):
    """A pool too small for all of them: requests are preempted and recompute their prompt and
    output; each prompt logprob is landed once, each output token's once, all equal HF's."""
    llm = LLM(tiny, engine="paged", num_blocks=16, block_size=4, max_num_batched_tokens=16)
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=20, logprobs=2, prompt_logprobs=2, ignore_eos=True,
                            temperature=0.8, seed=3)
    result = llm.run(llm.make_requests(prompts, params))
    assert result.metrics.num_preemptions > 0, "the tight pool should have preempted"
    for prompt, out in zip(prompts, result.outputs):
        check_output(tiny, prompt, out, 2, 2)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny):
    """The second request shares the first one's cached prefix; asking prompt_logprobs, it
    computes every prompt position anyway (no hit), and its numbers are HF's."""
    llm = LLM(tiny, engine="paged", enable_prefix_caching=True, block_size=4)
    llm.generate([PROMPT], SamplingParams(max_tokens=2))
    hits = llm.engine.prefix_hit_tokens
    llm.generate([PROMPT], SamplingParams(max_tokens=2))
    assert llm.engine.prefix_hit_tokens > hits, "the plain request should hit the cache"
    hits = llm.engine.prefix_hit_tokens
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=3))[0]
    assert llm.engine.prefix_hit_tokens == hits
    check_output(tiny, PROMPT, out, 1, 3)


def test_logprobs_are_raw_before_the_sampler_controls(tiny):
    """vLLM's "raw" mode: penalties and temperature change the choice, not the reported logprob."""
    llm = LLM(tiny, engine="paged")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, logprobs=1, temperature=0.7, seed=1,
                                                repetition_penalty=1.5, ignore_eos=True))[0]
    check_output(tiny, PROMPT, out, 1, None)


@pytest.mark.parametrize("engine,field", [("naive", "logprobs"), ("dynamic", "prompt_logprobs"),
                                          ("paged+ngram", "logprobs")])
def test_engines_that_cannot_refuse_by_name(tiny, engine, field):
    llm = LLM(tiny, engine=engine)
    with pytest.raises(RequestError, match=f"{field}=2 is not supported by engine"):
        llm.engine.validate(Request([1, 2, 3], SamplingParams(**{field: 2})))


@pytest.mark.parametrize("bad,match", [
    (dict(logprobs=21), "logprobs must be an integer in \\[0, 20\\], got 21"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be an integer in \\[0, 20\\]"),
    (dict(logprobs=True), "logprobs must be an integer"),
    (dict(logprobs=1, beam_width=2), "logprobs=1 needs beam_width=1"),
])
def test_bad_logprobs_values_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


# --- served, through the official client ---------------------------------------------------------
@pytest.fixture(scope="module")
def api(tiny):
    llm = LLM(tiny, engine="paged", num_blocks=128, block_size=4, max_num_batched_tokens=16)
    with running_server(llm) as (url, _):
        # the server's engine loop holds its engine: offline references run on another one
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60), LLM(tiny)


def test_completions_echo_logprobs_equal_hf(tiny, api):
    """lm-evaluation-harness's loglikelihood request: token ids as the prompt, echo, logprobs, and
    max_tokens 0 or 1; each prompt token's logprob is HF's (the first is null), offsets add up."""
    client, llm = api
    for max_tokens in (0, 1, 5):
        r = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=max_tokens,
                                      echo=True, logprobs=3, temperature=0)
        choice = r.choices[0]
        lp = choice.logprobs
        generated = len(lp.tokens) - len(PROMPT)
        assert generated == max_tokens and r.usage.completion_tokens == max_tokens
        ref = hf_logprobs(tiny, PROMPT)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for j in range(1, len(PROMPT)):
            assert abs(lp.token_logprobs[j] - ref[j - 1, PROMPT[j]].item()) < TOL
            assert len(lp.top_logprobs[j]) >= 1     # keyed by text: two ids may share one
            assert max(lp.top_logprobs[j].values()) == pytest.approx(ref[j - 1].max().item(),
                                                                     abs=TOL)
        assert lp.text_offset[0] == 0
        assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:],
                                                       lp.tokens))
        assert "".join(lp.tokens) == choice.text
        if max_tokens == 0:
            assert choice.finish_reason == "length"


def test_completions_logprobs_of_the_output_equal_offline(api):
    client, llm = api
    want = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, logprobs=2))[0]
    r = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8,
                                  logprobs=2, temperature=0, extra_body={"return_token_ids": True})
    lp = r.choices[0].logprobs
    assert r.choices[0].token_ids == want.token_ids
    for got, entry, token in zip(lp.token_logprobs, want.logprobs, want.token_ids):
        assert got == pytest.approx(entry[token], abs=TOL)
    streamed = client.completions.create(model="tiny-llama", prompt="Once upon a time",
                                         max_tokens=8, logprobs=2, temperature=0, stream=True,
                                         echo=True)
    tokens, values = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    prompt_len = len(llm.encode("Once upon a time"))
    assert len(values) == prompt_len + 8 and values[0] is None
    assert values[prompt_len:] == pytest.approx(lp.token_logprobs, abs=TOL)


def test_chat_logprobs_and_top_logprobs(api):
    client, llm = api
    messages = [{"role": "user", "content": "Say hi"}]
    want = llm.generate([messages], SamplingParams(max_tokens=6, logprobs=3))[0]
    r = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for item, entry, token in zip(content, want.logprobs, want.token_ids):
        assert item.logprob == pytest.approx(entry[token], abs=TOL)
        assert len(item.top_logprobs) == 3 and bytes(item.bytes).decode() == item.token
        top = sorted(entry.values(), reverse=True)[:3]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(top, abs=TOL)
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            stream=True)
    streamed = [c for ch in stream for c in ((ch.choices[0].logprobs.content or [])
                                             if ch.choices and ch.choices[0].logprobs else [])]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=TOL)


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny-llama", "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": "tiny-llama", "prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"model": "tiny-llama", "prompt": "hi", "echo": "yes"}, "echo"),
])
def test_bad_logprob_fields_are_400s_naming_them(api, body, param):
    client, _ = api
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body)
    assert e.value.body["param"] == param


def test_chat_top_logprobs_needs_logprobs(api):
    client, _ = api
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user",
                                                                      "content": "hi"}],
                                       top_logprobs=2, max_tokens=2)
    assert e.value.body["param"] == "top_logprobs"


def test_what_json_cannot_carry_is_clamped_to_finite_values():
    """JSON has no NaN or infinity (Starlette's encoder refuses them: a 500): -inf and NaN (a row
    with no allowed token, which the sampler never draws from) are sent as the floor, +inf as 0;
    the objects built from them encode."""
    import json
    import math
    from minillm.serve.logprobs import FLOOR, clamp, completion_logprobs, TokenText
    nan, inf = float("nan"), float("inf")
    assert clamp(nan) == FLOOR and clamp(-inf) == FLOOR and clamp(-1e30) == FLOOR
    assert clamp(inf) == 0.0 and clamp(-0.5) == -0.5 and clamp(0.0) == 0.0

    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + i) for i in ids)

    obj, _ = completion_logprobs(TokenText(Tok()), [0, 1], [{0: nan, 1: -inf}, {1: nan, 2: inf}])
    text = json.dumps(obj, allow_nan=False)
    assert all(math.isfinite(v) for v in obj["token_logprobs"]), text
