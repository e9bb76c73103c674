"""The sampler's controls: presence/frequency/repetition penalties, min_p, min_tokens and
logit_bias, applied as per-row tensor operations over the batch (``minillm.sampling.
apply_controls``). Each is checked against a plain per-row reference over random logits and
parameters (hypothesis), repetition_penalty against Hugging Face's own processor; min_tokens
never ends early; seeded requests sample the same tokens alone or in a batch; the server takes
every field through the official ``openai`` client."""
from __future__ import annotations

from collections import Counter

import httpx
import openai
import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from minillm import LLM, SamplingParams
from minillm.request import Request, RequestError
from minillm.sampling import apply_controls
from serve_util import running_server

VOCAB = 24
EOS = frozenset({3})


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
              eos: frozenset[int]) -> torch.Tensor:
    """One row, one control at a time, token by token: what the batched version must equal."""
    x = logits.clone().float()
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = float("-inf")
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.min_p > 0 and not p.greedy:
        probs = torch.softmax(x / p.temperature, -1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    return x


ids = st.lists(st.integers(0, VOCAB - 1), max_size=12)
params = st.builds(
    SamplingParams, max_tokens=st.just(20), temperature=st.sampled_from([0.0, 0.5, 1.0]),
    presence_penalty=st.sampled_from([0.0, -1.5, 0.7, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3, -2.0]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]), min_p=st.sampled_from([0.0, 0.1, 0.5]),
    min_tokens=st.integers(0, 6), ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    logit_bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(params, ids, ids), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_controls_equal_a_per_row_reference(rows, seed):
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    ps = [p for p, _, _ in rows]
    histories = [(prompt, output) for _, prompt, output in rows]
    changed, got = apply_controls(logits, ps, histories, EOS)
    assert changed == [i for i, p in enumerate(ps) if p.needs_processing]
    for j, i in enumerate(changed):
        want = reference(logits[i], ps[i], *histories[i], EOS)
        torch.testing.assert_close(got[j], want, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(prompt=ids, output=ids, penalty=st.floats(0.2, 3.0), seed=st.integers(0, 99))
def test_repetition_penalty_equals_hugging_face(prompt, output, penalty, seed):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed))
    p = SamplingParams(repetition_penalty=penalty)
    _, got = apply_controls(logits, [p], [(prompt, output)]) if penalty != 1 else ([], logits)
    seen = torch.tensor([prompt + output or [0]], device=logits.device)
    want = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone()) if prompt + output \
        else logits
    torch.testing.assert_close(got, want)


def test_rows_without_controls_are_not_touched():
    logits = torch.randn(3, VOCAB)
    rows, got = apply_controls(logits, [SamplingParams()] * 3, None)
    assert rows == [] and got.shape[0] == 0


def test_min_tokens_never_ends_early(tiny):
    """A bias makes token 7 almost certain and 7 is a stop token: without min_tokens the output
    is [7]; with min_tokens=5 token 7 is masked until 5 tokens exist, then it ends the output."""
    llm = LLM(tiny, engine="paged")
    base = dict(max_tokens=12, stop_token_ids=[7], logit_bias={7: 100.0})
    assert llm.generate([[5, 6]], SamplingParams(**base))[0].token_ids == [7]
    for engine in ("paged", "dynamic"):
        out = LLM(tiny, engine=engine).generate([[5, 6]], SamplingParams(**base, min_tokens=5,
                                                                         temperature=0.9, seed=1))
        assert out[0].token_ids[:5].count(7) == 0 and out[0].token_ids[5:] == [7], engine


def test_seeded_sampling_with_controls_is_batch_invariant(tiny):
    llm = LLM(tiny, engine="paged")
    target = SamplingParams(max_tokens=16, temperature=1.0, seed=42, presence_penalty=0.8,
                            frequency_penalty=0.4, repetition_penalty=1.3, min_p=0.05,
                            logit_bias={9: 3.0}, min_tokens=3, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8]], target)[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=0.7, seed=i, presence_penalty=0.1 * i)
              for i in range(5)]
    mixed = llm.generate([[9 + i, 4, 2] for i in range(5)] + [[5, 6, 7, 8]], others + [target])
    assert mixed[-1].token_ids == alone


def test_penalties_change_greedy_output_as_the_reference_says(tiny):
    """End to end on the model: each greedy token equals the argmax of HF's logits after the
    per-row reference controls, given the tokens so far."""
    llm = LLM(tiny, engine="paged")
    p = SamplingParams(max_tokens=8, frequency_penalty=2.0, repetition_penalty=1.5,
                       logit_bias={11: 1.5}, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    out = llm.generate([prompt], p)[0].token_ids
    for i, token in enumerate(out):
        with torch.no_grad():
            logits = tiny.hf_model(torch.tensor([prompt + out[:i]], device=tiny.device)).logits[0, -1]
        assert reference(logits, p, prompt, out[:i], frozenset()).argmax().item() == token


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.5), ("min_tokens", 2),
                                         ("logit_bias", {1: 2.0}), ("repetition_penalty", 1.2)])
def test_speculative_engine_refuses_them_by_name(tiny, field, value):
    llm = LLM(tiny, engine="paged+ngram")
    with pytest.raises(RequestError, match=f"{field}=.* is not supported by engine"):
        llm.engine.validate(Request([1, 2, 3], SamplingParams(**{field: value})))


@pytest.mark.parametrize("bad,match", [
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2.0, 2.0\\], got 2.5"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
    (dict(repetition_penalty=-1), "repetition_penalty must be > 0, got -1"),
    (dict(min_p=1.5), "min_p must be in \\[0.0, 1.0\\], got 1.5"),
    (dict(min_tokens=-1), "min_tokens must be an integer in \\[0, 64\\], got -1"),
    (dict(logit_bias={5: 101}), "logit_bias\\[5\\] must be in \\[-100, 100\\], got 101"),
    (dict(logit_bias={"a": 1}), "logit_bias key must be an integer"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
    (dict(beam_width=2, min_p=0.1), "min_p=0.1 needs beam_width=1"),
])
def test_bad_values_name_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny):
    with pytest.raises(RequestError, match="logit_bias token id 9999 is outside the vocabulary"):
        LLM(tiny).engine.validate(Request([1, 2], SamplingParams(logit_bias={9999: 1.0})))


def test_the_server_takes_every_control(tiny):
    offline = LLM(tiny, engine="paged")
    fields = dict(presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.4, min_p=0.1,
                  min_tokens=4, logit_bias={11: 2.0})
    want = offline.generate(["Once upon"], SamplingParams(max_tokens=10, **fields))[0].token_ids
    with running_server(LLM(tiny, engine="paged", num_blocks=64)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
        r = client.completions.create(
            model="tiny-llama", prompt="Once upon", max_tokens=10, temperature=0,
            presence_penalty=0.5, frequency_penalty=0.8, logit_bias={"11": 2.0},
            extra_body={"repetition_penalty": 1.4, "min_p": 0.1, "min_tokens": 4,
                        "return_token_ids": True})
        assert r.choices[0].token_ids == want
        chat = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0, presence_penalty=-1.0, logit_bias={"11": -100},
            extra_body={"min_tokens": 2})
        assert chat.choices[0].message.content is not None
        for body, param in [({"presence_penalty": 3}, "presence_penalty"),
                            ({"logit_bias": {"x": 1}}, "logit_bias"),
                            ({"logit_bias": {"99999": 1}}, "logit_bias"),
                            ({"min_tokens": 99}, "min_tokens"), ({"min_p": -0.1}, "min_p"),
                            ({"repetition_penalty": 0}, "repetition_penalty")]:
            r = httpx.post(f"{url}/v1/completions", timeout=30,
                           json={"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
