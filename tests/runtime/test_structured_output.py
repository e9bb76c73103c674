"""Structured output: a grammar's mask per row per step, applied in the one sampler,
the grammar advanced at the one commit point (``minillm/structured.py``). Every output is parsed
and validated with ``jsonschema`` (or matched against its regex / choices): greedy, seeded
sampling, n = 3, under preemption and chunked prefill, on rungs 2 and 3; rows without a grammar
sample the same tokens as in a batch without constrained rows; the server takes OpenAI's
``response_format`` and vLLM's ``structured_outputs`` through the official ``openai`` client, and
an invalid schema is a 400 naming ``response_format``; the KV pool returns to full.

The tiny random model writes random bytes: its strings are bounded by ``pattern`` (xgrammar
0.2.8 lets a ``maxLength`` string hold raw control characters, which JSON forbids) and its JSON
is compact (``disable_any_whitespace``: it would otherwise fill max_tokens with newlines).
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.checks import FieldError
from minillm.request import Request, RequestError
from minillm import grammar_compiler
from minillm.checks import FieldError
from minillm.structured import MAX_CHOICES, MAX_GRAMMAR_BYTES, MAX_REGEX_BYTES, MAX_SCHEMA_DEPTH
from minillm.structured import StructuredOutputsParams as SO
from minillm.structured import compiler_for
from serve_util import running_server

WORD = {"type": "string", "pattern": "^[a-z]{1,6}$"}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": WORD, "address": {"type": "object", "properties": {
            "city": WORD, "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"]}}, "required": ["name", "address"]},
    "enums_arrays": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": 1, "maxItems": 4},
        "ok": {"type": "boolean"}}, "required": ["color", "sizes", "ok"]},
    "list_of_objects": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": -50, "maximum": 50}, "tag": {"enum": ["a", "b"]}},
        "required": ["id", "tag"]}, "minItems": 1, "maxItems": 3},
}
PROMPTS = ["Describe a person:", "hello there", "{", "Give me JSON"]


def json_params(schema: dict, **kw) -> SamplingParams:
    so = SO(json=schema, disable_any_whitespace=True)
    return SamplingParams(max_tokens=kw.pop("max_tokens", 160), structured_outputs=so, **kw)


def check_json(out, schema: dict) -> None:
    assert out.finish_reason == "stop", f"the grammar never completed: {out.text!r}"
    jsonschema.validate(json.loads(out.text), schema)


def decoded(llm: LLM, out) -> list[str]:
    return [llm.tokenizer.decode(s, skip_special_tokens=True) for s in out.samples]


def assert_pool_full(llm: LLM) -> None:
    assert llm.engine.kv_counts().allocated == 0


@pytest.fixture(scope="module")
def paged(tiny):
    return LLM(tiny, engine="paged")


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.7, seed=5),
                                      dict(temperature=1.0, seed=1, n=3)])
def test_every_output_validates(paged, name, sampling):
    schema = SCHEMAS[name]
    outs = paged.generate(PROMPTS, json_params(schema, **sampling))
    for out in outs:
        assert set(out.finish_reasons) == {"stop"}, decoded(paged, out)
        for text in decoded(paged, out):
            jsonschema.validate(json.loads(text), schema)
    assert_pool_full(paged)


def test_choice_and_regex_outputs_match(paged):
    choices = ["yes", "no", "maybe not"]
    for out in paged.generate(PROMPTS, SamplingParams(
            max_tokens=20, temperature=1.0, seed=2, n=3, structured_outputs=SO(choice=choices))):
        assert all(t in choices for t in decoded(paged, out)), decoded(paged, out)
    pattern = r"[a-z]{2,4}-\d{3}"
    for out in paged.generate(PROMPTS, SamplingParams(
            max_tokens=20, temperature=0.9, seed=4, structured_outputs=SO(regex=pattern))):
        assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop", out.text


def test_a_complete_grammar_stops_even_with_ignore_eos(paged):
    out = paged.generate(["x"], SamplingParams(max_tokens=30, ignore_eos=True,
                                               structured_outputs=SO(choice=["ab"])))[0]
    assert out.text == "ab" and out.finish_reason == "stop"


def test_unconstrained_rows_are_not_touched(paged):
    """Constrained and free rows in one batch: the free rows sample exactly the tokens they
    sample in a batch of free rows only (greedy and seeded)."""
    free = [SamplingParams(max_tokens=24, ignore_eos=True),
            SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=7)]
    alone = paged.generate(PROMPTS[:2], free)
    mixed = paged.generate(PROMPTS, free + [json_params(SCHEMAS["nested"]),
                                            json_params(SCHEMAS["enums_arrays"], seed=3,
                                                        temperature=0.8)])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    check_json(mixed[2], SCHEMAS["nested"])
    check_json(mixed[3], SCHEMAS["enums_arrays"])


@pytest.mark.parametrize("options", [
    dict(num_blocks=56, block_size=4, max_num_batched_tokens=16),     # preempts
    dict(max_num_batched_tokens=8, block_size=4),                      # chunked prefill
])
def test_preemption_and_chunked_prefill_keep_the_grammar(tiny, paged, options):
    """A matcher advances only on committed tokens: a request preempted (its tokens kept, its
    K/V recomputed) or prefilled in chunks goes on where it stood, same tokens as a roomy run."""
    schema = SCHEMAS["list_of_objects"]
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    params = json_params(schema, temperature=0.8, seed=11, n=2, max_tokens=90)
    want = paged.generate(prompts, params)
    tight = LLM(tiny, engine="paged", **options)
    result = tight.run(tight.make_requests(prompts, params))
    assert result.metrics.num_errors == 0, [o.error for o in result.outputs]
    if "num_blocks" in options:
        assert result.metrics.num_preemptions > 0, "the tight pool should have preempted"
    assert [o.samples for o in result.outputs] == [o.samples for o in want]
    for out in result.outputs:
        for text in decoded(tight, out):
            jsonschema.validate(json.loads(text), schema)
    assert_pool_full(tight)


def test_rung_2_follows_the_same_grammar(tiny, paged):
    """Rungs 0-2 sample with the same sampler and commit through ``Request.commit``."""
    params = json_params(SCHEMAS["enums_arrays"])
    dynamic = LLM(tiny, engine="dynamic").generate(PROMPTS, params)
    assert [o.token_ids for o in dynamic] == [o.token_ids for o in paged.generate(PROMPTS, params)]


def test_grammars_are_compiled_once_per_spec(tiny):
    compiler = compiler_for(tiny.tokenizer, tiny.config.vocab_size, tiny.eos_token_ids)
    a = compiler.compile(SO(json=SCHEMAS["nested"]))
    assert compiler.compile(SO(json=json.dumps(SCHEMAS["nested"]))) is a
    assert compiler.compile(SO(json=SCHEMAS["nested"], disable_any_whitespace=True)) is not a


def nested(depth: int) -> dict:
    """A schema whose JSON nests ``depth`` levels deep (each object level adds two)."""
    schema: dict = {"type": "string"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"x": schema} if depth % 2 == 0 else schema


def looped() -> dict:
    """A dict that contains itself (JSON cannot say it; a Python caller can)."""
    schema: dict = {"type": "object", "properties": {}}
    schema["properties"]["self"] = schema
    return schema

@pytest.mark.parametrize("bad,match", [
    (dict(json={"type": "foo"}), 'structured_outputs.json: invalid json: Unsupported type "foo"'),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1]), "structured_outputs.json must be a JSON schema"),
    (dict(regex="(ab"), "structured_outputs.regex: invalid regex: .*parenthesis"),
    (dict(choice=[]), "structured_outputs.choice must be a list of non-empty strings"),
    (dict(choice="yes"), "structured_outputs.choice must be a list"),
    (dict(json_object=True, regex="a"), "exactly one of json, regex, choice, json_object"),
    (dict(), "exactly one of"),
    (dict(regex="a", color=1), "unknown structured_outputs field"),
    (dict(choice=[str(i) for i in range(MAX_CHOICES + 1)]),
     f"structured_outputs.choice has {MAX_CHOICES + 1} choices, more than the {MAX_CHOICES}"),
    (dict(regex="a" * (MAX_REGEX_BYTES + 1)),
     f"structured_outputs.regex is {MAX_REGEX_BYTES + 1} bytes, more than the"),
    (dict(json=json.dumps({"description": "é" * MAX_GRAMMAR_BYTES})),
     "structured_outputs.json is .* bytes, more than the"),
    (dict(json=nested(MAX_SCHEMA_DEPTH + 1)), f"nests more than {MAX_SCHEMA_DEPTH} levels"),
    (dict(json="[" * 50_000 + "]" * 50_000), "not valid JSON: it is nested too deeply"),
    (dict(json=looped()), f"nests more than {MAX_SCHEMA_DEPTH} levels"),
])
def test_bad_specs_are_value_errors_naming_the_problem(bad, match):
    """Each names its field, in the message and as data (``FieldError.field``, the server's
    ``param``); the size limits are checked before xgrammar parses anything."""
    with pytest.raises(FieldError, match=match) as e:
        SamplingParams(structured_outputs=bad)
    assert e.value.field.startswith("structured_outputs")


def test_the_size_limits_admit_the_largest_grammar_they_allow(tiny):
    choices = [f"{i:05d}" for i in range(MAX_CHOICES)]
    so = SO(choice=choices)
    assert len(so.choice) == MAX_CHOICES
    SO(json=nested(MAX_SCHEMA_DEPTH))
    SO(regex="a" * MAX_REGEX_BYTES)
    SO(json={"description": "d" * (MAX_GRAMMAR_BYTES - 100)})



def test_combinations_that_cannot_work_are_refused(tiny):
    with pytest.raises(ValueError, match="structured_outputs needs beam_width=1"):
        SamplingParams(beam_width=2, structured_outputs=SO(choice=["a"]))
    with pytest.raises(ValueError, match="min_tokens=2 cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=SO(choice=["a"]))


def test_guessed_rows_are_masked_by_the_state_after_the_guesses_before(tiny):
    """Row i of a speculating sequence's logits is masked as plain decoding would mask it after
    guesses[:i]; a guess the grammar refuses ends the walk (the rows after it stay untouched);
    the matcher is where it stood afterwards (the commit advances it by what is kept)."""
    import xgrammar as xgr
    from minillm.structured import mask_guessed_rows
    compiled = compiler_for(tiny.tokenizer, tiny.config.vocab_size, tiny.eos_token_ids).compile(
        SO(choice=["abc", "abd"]))
    matcher = xgr.GrammarMatcher(compiled)
    tok = {ch: tiny.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcdx"}
    logits = torch.zeros(4, tiny.config.vocab_size)
    mask_guessed_rows(logits, matcher, [tok["a"], tok["b"], tok["x"]])
    allowed = [set((row > float("-inf")).nonzero().flatten().tolist()) for row in logits]
    assert allowed[0] == {tok["a"]} and allowed[1] == {tok["b"]}
    assert allowed[2] == {tok["c"], tok["d"]}          # "x" is refused here: the walk ends
    assert len(allowed[3]) == tiny.config.vocab_size   # never read: left as it was
    again = torch.zeros(1, tiny.config.vocab_size)
    mask_guessed_rows(again, matcher, [])
    assert set((again[0] > float("-inf")).nonzero().flatten().tolist()) == {tok["a"]}


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=3)])
def test_speculative_decoding_verifies_its_guesses_under_the_mask(tiny, paged, method, sampling):
    """Rung 6 under a grammar: greedy and seeded tokens equal the paged engine's (each guessed
    position masked, the matcher rolled back past rejected guesses), every output validates,
    guesses were made (the n-gram's often kept; the random draft's all refused by the grammar),
    and the pool returns to full."""
    schema = SCHEMAS["list_of_objects"]
    params = json_params(schema, max_tokens=120, **sampling)
    want = paged.generate(PROMPTS, params)
    spec = LLM(tiny, engine=f"paged+{method}")
    got = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out in got:
        check_json(out, schema)
    stats = spec.engine.run_stats
    assert stats.num_proposed > 0 and (stats.num_accepted > 0 or method == "draft"), stats
    assert_pool_full(spec)


def test_the_server_takes_response_format_and_structured_outputs(tiny):
    schema = SCHEMAS["enums_arrays"]
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    with running_server(LLM(tiny, engine="paged", num_blocks=64)) as (url, app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                      "strict": True}}
        chat = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "JSON please"}], n=2,
            temperature=0.7, seed=1, max_tokens=160, response_format=fmt, extra_body=compact)
        for choice in chat.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
        done = client.completions.create(model="tiny-llama", prompt="{", max_tokens=160,
                                         temperature=0, extra_body={"response_format": fmt,
                                                                    **compact})
        jsonschema.validate(json.loads(done.choices[0].text), schema)
        pick = client.completions.create(model="tiny-llama", prompt="?", max_tokens=10,
                                         extra_body={"structured_outputs": {"choice": ["A", "B"]}})
        assert pick.choices[0].text in ("A", "B")
        stream = client.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "go"}], max_tokens=160,
            temperature=0, stream=True, response_format=fmt, extra_body=compact)
        jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream
                                               if c.choices)), schema)
        for body, param, words in [
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "foo"}}}}, "response_format", "Unsupported type"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
             "response_format", "needs json_schema.schema"),
            ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "regex"),
            ({"response_format": {"type": "json_object"},
              "structured_outputs": {"regex": "a"}}, "response_format", "exactly one")]:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
                "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], **body})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and words in err["message"], \
                (body, r.text)
        with pytest.raises(openai.BadRequestError, match="Unsupported type"):
            client.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "hi"}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "foo"}}})
        assert app.state.llm.engine.kv_counts().allocated == 0


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_smollm2_writes_valid_json(smol, temperature):
    """A real model, compact JSON (with any whitespace allowed, SmolLM2-135M at temperature 0
    writes "{" then newlines until max_tokens)."""
    llm = LLM(smol, engine="paged")
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                    "maxItems": 3}},
        "required": ["name", "age", "hobbies"]}
    chats = [[{"role": "user", "content": f"Describe {who} as JSON."}]
             for who in ("a pirate", "a chef")]
    so = SO(json=schema, disable_any_whitespace=True)
    for out in llm.generate(chats, SamplingParams(max_tokens=96, temperature=temperature,
                                                  seed=0, structured_outputs=so)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_smollm2_json_object_outputs_are_json_objects(smol, temperature):
    """``json_object``: any JSON object, compact (with whitespace allowed SmolLM2-135M can
    repeat keys until max_tokens on one of these, at temperature 0)."""
    llm = LLM(smol, engine="paged")
    asks = ["Give a JSON object describing a pirate with keys name and age.",
            "Return a JSON object with the keys city and country for Paris.",
            "Write a JSON object with a key 'colors' listing three colors.",
            "Describe a cat as a JSON object with keys name, age and color."]
    so = SO(json_object=True, disable_any_whitespace=True)
    outs = llm.generate([[{"role": "user", "content": a}] for a in asks],
                        SamplingParams(max_tokens=128, temperature=temperature, seed=0,
                                       structured_outputs=so))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict), out.text


def test_the_mask_bench_times_both_fills_and_refuses_too_few_steps(capsys):
    """``python -m minillm.bench.structured_mask``: one JSON line with both fills' times; fewer
    steps than its warm-up is refused naming the flag (no step would be left for a median)."""
    from minillm.bench import structured_mask
    from minillm.models import load_model
    structured_mask.main(["--model", "tiny-llama", "--rows", "3", "--steps", "7"])
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == 3 and out["device"] == str(load_model("tiny-llama").device)   # cuda where there is one
    assert out["mask_ms_median"] > 0 and out["batch_matcher_ms_median"] > 0
    with pytest.raises(SystemExit):
        structured_mask.main(["--model", "tiny-llama", "--steps", "5"])
    assert "--steps" in capsys.readouterr().err


# --- grammars that admit nothing, dead ends, the compile cache -----------------------------------
def test_a_grammar_that_admits_no_string_is_refused(paged):
    """Refused when compiled (its first mask allows no token), not run to a garbage "stop"."""
    so, field = SO(regex=r"[^\s\S]"), "structured_outputs.regex"
    out = paged.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=so))[0]
    assert out.finish_reason == "error" and f"{field} admits no string" in out.error
    assert out.token_ids == []
    assert_pool_full(paged)


@pytest.mark.parametrize("schema,words", [
    ({"$ref": "#"}, "Circular $ref"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "cannot accept any value")])
def test_a_schema_no_value_satisfies_is_refused_when_the_params_are_built(paged, schema, words):
    """xgrammar (>= 0.2.9) will not parse such a schema: the params are refused before any
    request exists, naming the field and what xgrammar said; the engine is untouched."""
    with pytest.raises(FieldError) as e:
        SO(json=schema)
    assert e.value.field == "structured_outputs.json" and words in str(e.value), str(e.value)
    assert paged.generate(["x"], SamplingParams(max_tokens=2))[0].finish_reason == "length"
    assert_pool_full(paged)


@pytest.mark.parametrize("engine", ["paged", "dynamic", "paged+ngram", "paged+draft"])
def test_a_row_whose_grammar_allows_no_token_is_not_sampled(tiny, engine):
    """``a[^\\s\\S]`` allows "a", then nothing: that row gets no draw (no token 0 marked
    "stop"), its request alone fails, naming the field, with the logprobs of what it did commit
    (finite); the rows beside it sample exactly what they sample alone. Rung 6 too, whose
    verification masks the rows of a sequence's guesses."""
    llm = LLM(tiny, engine=engine)
    free = [SamplingParams(max_tokens=16, ignore_eos=True),
            SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=7)]
    alone = llm.generate(PROMPTS[:2], free)
    dead = SamplingParams(max_tokens=8, temperature=0.8, seed=1,
                          structured_outputs=SO(regex=r"a[^\s\S]"),
                          logprobs=2 if engine == "paged" else None)
    mixed = llm.generate(PROMPTS[:3], free + [dead])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    out = mixed[2]
    assert out.finish_reason == "error", out
    assert "structured_outputs.regex: the grammar allows no token after the 1 token" in out.error
    assert out.text == "a"
    if engine == "paged":
        assert len(out.logprobs) == 1 and all(v == v for v in out.logprobs[0].values())
    if engine.startswith("paged"):
        assert llm.engine.kv_counts().allocated == 0


def test_a_grammar_compiles_once_for_threads_that_ask_together(tiny, monkeypatch):
    """Four threads ask for one new grammar while its compile is held: one compile, one result;
    the lock is not held while compiling (another grammar compiles meanwhile)."""
    import threading
    compiler = compiler_for(tiny.tokenizer, tiny.config.vocab_size, tiny.eos_token_ids)
    entered, release, calls = threading.Event(), threading.Event(), []
    real = grammar_compiler.GrammarCompiler.build

    def held(self, so):
        calls.append(so.choice)
        if so.choice == ("together-1", "together-2"):
            entered.set()
            release.wait(120)
        return real(self, so)

    monkeypatch.setattr(grammar_compiler.GrammarCompiler, "build", held)
    got = []
    threads = [threading.Thread(target=lambda: got.append(compiler.compile(
        SO(choice=["together-1", "together-2"])))) for _ in range(4)]
    threads[0].start()
    assert entered.wait(60)
    for t in threads[1:]:
        t.start()
    try:
        other = compiler.compile(SO(choice=["meanwhile"]))    # not blocked by the held one
        assert other is not None
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert len(got) == 4 and all(g is got[0] for g in got)
    assert calls.count(("together-1", "together-2")) == 1


def test_the_compile_cache_is_bounded(tiny, monkeypatch):
    compiler = grammar_compiler.GrammarCompiler(tiny.tokenizer, tiny.config.vocab_size,
                                                sorted(tiny.eos_token_ids))
    monkeypatch.setattr(grammar_compiler, "MAX_GRAMMARS", 2)
    first = compiler.compile(SO(choice=["one"]))
    compiler.compile(SO(choice=["two"]))
    compiler.compile(SO(choice=["three"]))
    assert len(compiler.compiled) == 2
    assert compiler.compile(SO(choice=["one"])) is not first       # the oldest went
    monkeypatch.setattr(grammar_compiler, "MAX_CACHE_BYTES", 0)
    compiler.compile(SO(choice=["four"]))
    assert len(compiler.compiled) == 0
