"""Structured output on the server: a grammar is parsed and compiled off the event loop
and off the tokenizer thread, once, within a time bound; a grammar too big, too slow, or that
admits no string is a 400 naming the field; a grammar that dead-ends mid-output fails its own
request (a 400, never a 500, logprobs or not) while the others are served; and every refusal's
``param`` is a field of the request. No test reads the clock: a compile is held on an Event the
test controls, and the time bound is tested with one that is never released in time.
"""
from __future__ import annotations

import itertools
import json
import threading

import httpx
import pytest

from minillm import LLM, SamplingParams
from minillm.grammar_compiler import GrammarCompiler
from minillm.serve.protocol import ChatCompletionRequest, CompletionRequest
from minillm.structured import MAX_CHOICES, MAX_GRAMMAR_BYTES, MAX_REGEX_BYTES, MAX_SCHEMA_DEPTH
from minillm.structured import StructuredOutputsParams
from serve_util import offline, running_server  # noqa: F401 (fixtures)

MODEL = "tiny-llama"
_unique = itertools.count()


def fresh(word: str) -> list[str]:
    """Choices no other test compiled (compiled grammars are cached for the whole process)."""
    return [f"{word}-{next(_unique)}-{i}" for i in range(2)]


def post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    prompt = {"prompt": "x"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "x"}]}
    return httpx.post(f"{url}{path}", json={"model": MODEL, **prompt, **body}, timeout=120)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.fixture(scope="module")
def served(tiny):
    """A server whose grammar time bound no test reaches (the held compiles are released)."""
    llm = LLM(tiny, engine="paged", num_blocks=96, max_num_seqs=16)
    with running_server(llm, grammar_timeout_s=600) as (url, app):
        yield url, app


def held(monkeypatch, target, name: str, every: bool = False):
    """Make ``target.name`` wait, on its first call (``every``: on each), until the test
    releases it; returns (entered, release) Events."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(target, name)

    def waiting(*args, **kwargs):
        if every or not entered.is_set():
            entered.set()
            release.wait(300)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, waiting)
    return entered, release


def in_background(fn) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", fn()), daemon=True)
    thread.start()
    return thread, result


def test_a_plain_request_is_served_while_a_grammar_compiles(served, offline, monkeypatch):
    """The compile is held: /health, /v1/models and a plain completion are answered meanwhile
    (the tokenizer thread is free), and the grammar's request is answered once it is released."""
    url, app = served
    entered, release = held(monkeypatch, GrammarCompiler, "build")
    choices = fresh("compile")
    thread, result = in_background(
        lambda: post(url, {"structured_outputs": {"choice": choices}, "max_tokens": 20}))
    try:
        assert entered.wait(60), "the grammar never reached its compile"
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 200
        plain = post(url, {"prompt": "Hello there", "max_tokens": 6, "temperature": 0})
        want = offline.generate(["Hello there"], SamplingParams(max_tokens=6))[0].text
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == want
        assert "r" not in result, "the grammar's request cannot be answered before its compile"
    finally:
        release.set()
        thread.join(120)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["choices"][0]["text"] in choices


def test_a_grammar_is_parsed_off_the_event_loop(served, monkeypatch):
    """xgrammar's parse of a schema (seconds for a deep one) is held: /health answers."""
    url, app = served
    entered, release = held(monkeypatch, StructuredOutputsParams, "grammar")
    schema = {"type": "object", "properties": {f"p{next(_unique)}": {"type": "integer"}},
              "required": []}
    thread, result = in_background(lambda: post(url, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "structured_outputs": {"disable_any_whitespace": True}, "max_tokens": 40}))
    try:
        assert entered.wait(60), "the schema was never parsed"
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        assert "r" not in result
    finally:
        release.set()
        thread.join(120)
    assert result["r"].status_code == 200, result["r"].text


def test_the_same_grammar_is_compiled_once(served, monkeypatch):
    url, app = served
    calls = []
    real = GrammarCompiler.build
    monkeypatch.setattr(GrammarCompiler, "build", lambda self, so: calls.append(so) or
                        real(self, so))
    body = {"structured_outputs": {"choice": fresh("once")}, "max_tokens": 20}
    threads = [in_background(lambda: post(url, body)) for _ in range(3)]
    for thread, result in threads:
        thread.join(120)
        assert result["r"].status_code == 200, result["r"].text
    assert post(url, body, "/v1/chat/completions").status_code == 200
    assert len(calls) == 1


def test_a_grammar_not_compiled_in_time_is_a_400_naming_the_limit(tiny, offline, monkeypatch):
    """The compile is held past a 0.05 s bound (never released in time: the outcome does not
    depend on the machine's speed): a 400 naming the field and the limit, and the server goes
    on serving."""
    entered, release = held(monkeypatch, GrammarCompiler, "build", every=True)
    with running_server(LLM(tiny, engine="paged", num_blocks=64),
                        grammar_timeout_s=0.05) as (url, app):
        try:
            err = error_of(post(url, {"structured_outputs": {"choice": fresh("slow")}}))
            assert err["param"] == "structured_outputs.choice" and err["code"] == \
                "grammar_too_slow" and "0.05 s" in err["message"], err
            schema = {"type": "object", "properties": {f"q{next(_unique)}": {"type": "string"}}}
            err = error_of(post(url, {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": schema}}}, "/v1/chat/completions"))
            assert err["param"] == "response_format" and "0.05 s" in err["message"], err
            plain = post(url, {"max_tokens": 4})
            assert plain.status_code == 200, plain.text
        finally:
            release.set()


@pytest.mark.parametrize("so,param,words", [
    ({"choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, "structured_outputs.choice",
     f"more than the {MAX_CHOICES} allowed"),
    ({"choice": ["x" * (MAX_GRAMMAR_BYTES // 2 + 1), "y" * (MAX_GRAMMAR_BYTES // 2)]},
     "structured_outputs.choice", f"more than the {MAX_GRAMMAR_BYTES} allowed"),
    ({"regex": "a" * (MAX_REGEX_BYTES + 1)}, "structured_outputs.regex",
     f"more than the {MAX_REGEX_BYTES} allowed"),
    ({"json": {"type": "object", "description": "d" * MAX_GRAMMAR_BYTES}},
     "structured_outputs.json", f"more than the {MAX_GRAMMAR_BYTES} allowed"),
    ({"regex": r"[^\s\S]"}, "structured_outputs.regex", "admits no string"),
    ({"json": {"$ref": "#"}}, "structured_outputs.json", "invalid json: Circular $ref"),
])
def test_grammars_too_big_or_empty_are_400s_naming_the_field(served, so, param, words):
    url, app = served
    err = error_of(post(url, {"structured_outputs": so}))
    assert err["param"] == param and words in err["message"], err
    assert post(url, {"max_tokens": 2}).status_code == 200


def test_a_schema_nested_too_deep_is_a_400_naming_response_format(served):
    url, app = served
    schema: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "object", "properties": {"a": schema}}
    err = error_of(post(url, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": schema}}}, "/v1/chat/completions"))
    assert err["param"] == "response_format" and f"more than {MAX_SCHEMA_DEPTH} levels" in \
        err["message"], err
    err = error_of(post(url, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "empty", "schema": {"$ref": "#"}}}}, "/v1/chat/completions"))
    assert err["param"] == "response_format" and "invalid json: Circular $ref" in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [None, 3])
def test_a_grammar_that_dead_ends_fails_its_request_alone(served, offline, stream, logprobs):
    """``a[^\\s\\S]`` allows "a", then no token at all: that row is never sampled, its request
    ends with a 400 naming the field (an error chunk in a stream), never a 500 from a NaN
    logprob; a request beside it gets the offline engine's tokens, and the pool is full again."""
    url, app = served
    normal, result = in_background(lambda: post(url, {
        "prompt": "Hello there", "max_tokens": 24, "temperature": 0, "ignore_eos": True}))
    extra = {} if logprobs is None else {"logprobs": logprobs}
    r = post(url, {"structured_outputs": {"regex": r"a[^\s\S]"}, "max_tokens": 8,
                   "stream": stream, **extra})
    if stream:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        err = events[-1]["error"]
        assert "[DONE]" not in r.text
    else:
        err = error_of(r)
    assert err["param"] == "structured_outputs.regex" and "allows no token after the 1" in \
        err["message"], err
    normal.join(120)
    want = offline.generate(["Hello there"], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == \
        want.text
    bm = app.state.llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# --- every refusal names a field of the request -------------------------------------------------
GRAMMAR = {"structured_outputs": {"choice": ["a", "b"]}}
COMMON_REFUSALS = [
    {"min_tokens": 2, **GRAMMAR},                       # a field, never "min_tokens=2"
    {"min_tokens": 9, "max_tokens": 4},
    {"min_tokens": 9, "max_completion_tokens": 4},
    {"logit_bias": {"5": 200}},                         # a field, never "logit_bias[5]"
    {"logit_bias": {"x": 1}}, {"logit_bias": {"99999": 1}}, {"logit_bias": {"5": True}},
    {"logit_bias": {str(i): 1 for i in range(301)}},
    {"stop": ["a", "b", "c", "d", "e"]}, {"stop": [""]},
    {"stop_token_ids": [99999]}, {"stop_token_ids": list(range(257))},
    {"temperature": "1"}, {"temperature": True}, {"top_p": 0}, {"presence_penalty": 3},
    {"repetition_penalty": 0}, {"min_p": "0.5"}, {"seed": 2**70}, {"n": 0}, {"top_k": -1},
    {"max_tokens": 10**6}, {"ttft_slo_ms": -1}, {"priority": True},
    {"structured_outputs": {"regex": "(a"}}, {"structured_outputs": {"color": 1}},
    {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    {"structured_outputs": {"choice": []}}, {"structured_outputs": {"json": "{not json"}},
    {"structured_outputs": {"json_object": "yes"}},
    {"structured_outputs": {"regex": "a", "disable_any_whitespace": "no"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "foo"}}}},
    {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    {"response_format": {"type": "xml"}},
    {"tools": [{"type": "function"}]}, {"colour": "blue"},
]
REFUSALS = [("/v1/completions", b) for b in COMMON_REFUSALS + [
    {"prompt": ["a", "b"]}, {"prompt": ""}, {"prompt": [1, 99999]}, {"logprobs": 21},
    {"echo": "yes"}, {"suffix": "x"}]] + [("/v1/chat/completions", b) for b in COMMON_REFUSALS + [
        {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
        {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}]]


def assert_param_is_a_field(path: str, body: dict, err: dict) -> None:
    model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    param = err["param"]
    assert isinstance(param, str) and (param.split(".")[0] in model.model_fields
                                       or param in body), (path, body, err)


@pytest.mark.parametrize("path,body", REFUSALS)
def test_every_refusal_names_a_field_of_the_request(served, path, body):
    url, app = served
    r = post(url, body, path)
    assert_param_is_a_field(path, body, error_of(r))


def test_engine_refusals_name_the_field_too(tiny):
    """The engine's own refusals (``Engine.validate``: a field this engine cannot honour, n on
    a contiguous engine) carry their field: the 400 names the one the client sent."""
    with running_server(LLM(tiny, engine="dynamic", max_num_seqs=4)) as (url, app):
        for path, body, param in [
                ("/v1/completions", {"logprobs": 2}, "logprobs"),
                ("/v1/completions", {"echo": True, "logprobs": 0, "max_tokens": 0}, "logprobs"),
                ("/v1/completions", {"n": 2}, "n"),
                ("/v1/completions", {"min_p": 0.5}, None),          # honoured: 200
                ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2},
                 "top_logprobs")]:
            r = post(url, body, path)
            if param is None:
                assert r.status_code == 200, r.text
                continue
            err = error_of(r)
            assert err["param"] == param, (body, err)
            assert_param_is_a_field(path, body, err)


def test_a_grammar_that_is_not_unicode_is_a_400(served):
    """A JSON body can spell a lone surrogate (``"\\ud800"``): no grammar engine takes it."""
    url, app = served
    for so, param in ((b'{"regex": "a\\ud800"}', "structured_outputs.regex"),
                      (b'{"choice": ["\\ud800"]}', "structured_outputs.choice"),
                      (b'{"json": {"enum": ["\\ud800"]}}', "structured_outputs.json")):
        body = b'{"model": "tiny-llama", "prompt": "x", "structured_outputs": ' + so + b"}"
        r = httpx.post(f"{url}/v1/completions", content=body, timeout=60,
                       headers={"content-type": "application/json"})
        assert error_of(r)["param"] == param, r.text
