"""The server against hostile or careless clients: each request ends once with an answer
or an OpenAI-shaped error that names what was wrong, the KV pool is full again afterwards, and the
next ordinary request gets the offline engine's tokens.

Covered: a 50 MB body (413 at once; /health answers meanwhile), tokenizing off the event loop,
fields that would change the answer (400 naming them) and ``stop_token_ids`` (honoured), bodies
that are not JSON (not UTF-8, a 5,000-digit integer, 100,000 levels of nesting), 404/405/500,
``--api-key``, a pipeline worker that dies (503 until restarted), bad ``--port``/``--host``;
a 400-digit integer in any field (400 naming it; a request in flight is unharmed).
"""
from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from minillm import LLM, Request, SamplingParams
from minillm.request import RequestError
from serve_util import free_port, offline, running_server, server, wait_until  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
BIG = 50 * 1024 * 1024



def post(url: str, path: str = "/v1/completions", **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", timeout=60, **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI error body of ``r``, which must have ``status``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def assert_still_serving(url: str, app, offline, api_key: str = "unused") -> None:
    """Pool full, nothing in flight, and a normal request gets the offline engine's tokens."""
    loop = app.state.loop
    bm = loop.engine.block_manager
    wait_until(lambda: bm.num_free_blocks == bm.num_blocks and not loop.handles, 60,
               "the pool back to full")
    want = offline.generate(["Hello there"], SamplingParams(max_tokens=12))[0]
    got = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=60).completions.create(
        model=MODEL, prompt="Hello there", max_tokens=12, temperature=0,
        extra_body={"return_token_ids": True})
    assert got.choices[0].token_ids == want.token_ids
    assert got.choices[0].text == want.text


# --- item 1: a huge body must not freeze the server -------------------------------------------
def test_huge_body_is_refused_at_once_and_health_answers_meanwhile(server, offline):
    url, app = server
    limit = app.state.max_body_bytes
    health: list[int] = []

    def body():
        """50 MB, chunked (no Content-Length): the server must count. /health is asked while
        this request is still being sent, i.e. while the server is busy with it."""
        yield b'{"model": "tiny-llama", "prompt": "'
        for i in range(BIG // (1 << 20)):
            if i == 2:
                health.append(httpx.get(f"{url}/health", timeout=30).status_code)
            yield b"a" * (1 << 20)
        yield b'"}'

    result: dict = {}
    sender = threading.Thread(target=lambda: result.setdefault("r", post(
        url, content=body(), headers={"content-type": "application/json"})))
    sender.start()
    sender.join(120)
    assert not sender.is_alive(), "the 50 MB request never ended"
    assert health == [200]
    err = error_of(result["r"], 413)
    assert str(limit) in err["message"] and "--max-body-bytes" in err["message"]
    assert err["code"] == "body_too_large"
    # with a Content-Length header the answer comes before the body is read; /health, asked
    # meanwhile, answers (were the prompt tokenized on the event loop, it would wait ~45 s)
    result.clear()
    sender = threading.Thread(target=lambda: result.setdefault("r", post(
        url, content=b"x" * BIG, headers={"content-type": "application/json"})))
    sender.start()
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    sender.join(120)
    assert not sender.is_alive(), "the 50 MB request never ended"
    err = error_of(result["r"], 413)
    assert str(BIG) in err["message"] and str(limit) in err["message"]
    assert_still_serving(url, app, offline)


def test_tokenizing_runs_off_the_event_loop(server, offline):
    """While one request is being tokenized (held there by the test), /health and /v1/models
    answer: the tokenizer does not run on the event loop every client shares."""
    url, app = server
    llm = app.state.llm
    entered, release = threading.Event(), threading.Event()

    def slow_encode(prompt):
        entered.set()
        release.wait(60)
        return LLM.encode(llm, prompt)

    llm.encode = slow_encode
    try:
        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("r", post(url, json={
            "model": MODEL, "prompt": "Hello there", "max_tokens": 12, "temperature": 0})))
        t.start()
        assert entered.wait(60), "the request never reached the tokenizer"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200
        release.set()
        t.join(60)
    finally:
        release.set()
        del llm.encode
    want = offline.generate(["Hello there"], SamplingParams(max_tokens=12))[0].text
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == want


@pytest.mark.parametrize("prompt", [[5] * 100_000, "a" * 200_000])
def test_prompt_longer_than_the_context_is_a_400(server, offline, prompt):
    url, app = server
    err = error_of(post(url, json={"model": MODEL, "prompt": prompt}), 400)
    assert err["param"] == "prompt" and "longer than the model's context" in err["message"]
    assert "4096" in err["message"]
    assert_still_serving(url, app, offline)


def test_validate_checks_the_length_before_each_token(tiny):
    """A too-long prompt is refused for its length, before any per-token check looks at it."""
    llm = LLM(tiny, engine="paged", num_blocks=8)
    req = Request([5] * (tiny.max_model_len + 10) + ["not a token"], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="longer than the model's context"):
        llm.engine.validate(req)
    out = llm.generate([[5] * tiny.max_model_len], SamplingParams(max_tokens=2))[0]
    assert "longer than the model's context" in out.error


# --- item 2: fields that would change the answer --------------------------------------------
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "suffix", "the end"),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "include_stop_str_in_output", True),
    ("/v1/completions", "top_logprobs", 2),                            # a chat field
    ("/v1/completions", "foo", 1),
    ("/v1/chat/completions", "guided_json", {"type": "object"}),    # vLLM's old structured_outputs
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "echo", True),                           # a completions field
    ("/v1/chat/completions", "skip_special_tokens", False),
    ("/v1/chat/completions", "foo", None),
])
def test_fields_that_would_change_the_answer_are_refused(server, path, field, value):
    url, _ = server
    body = {"model": MODEL, "max_tokens": 4, field: value}
    body |= {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    err = error_of(post(url, path, json=body), 400)
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert f"'{field}' is not supported by minillm" in err["message"]


def test_metadata_and_neutral_values_are_accepted(server, offline):
    url, app = server
    want = offline.generate([CHAT], SamplingParams(max_tokens=6))[0].text
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0,
            "user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
            "parallel_tool_calls": True, "logit_bias": {}, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logprobs": False, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "repetition_penalty": 1.0, "min_tokens": 0}
    r = post(url, "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want
    r = post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "best_of": 1,
                        "echo": False, "suffix": None, "user": "u-1"})
    assert r.status_code == 200, r.text


def test_stop_token_ids_end_the_output_at_that_token(server, offline):
    url, app = server
    greedy = offline.generate(["Once upon a time"], SamplingParams(max_tokens=24))[0].token_ids
    stop = greedy[5]
    cut = greedy[:greedy.index(stop) + 1]           # the stop token is kept, as EOS is
    want = offline.generate(["Once upon a time"], SamplingParams(max_tokens=24,
                                                                 stop_token_ids=[stop]))[0]
    assert want.token_ids == cut
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24,
                "temperature": 0, "stop_token_ids": [stop], "return_token_ids": True}
        if not stream:
            choice = post(url, json=body).json()["choices"][0]
            assert choice["token_ids"] == cut and choice["text"] == want.text
            assert choice["finish_reason"] == "stop"
        else:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=60)
            text = "".join(ch.choices[0].text for ch in c.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                stream=True, extra_body={"stop_token_ids": [stop]}) if ch.choices)
            assert text == want.text
    # the stop token as the very last token max_tokens allows: the reason is still "stop"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": len(cut),
            "temperature": 0, "stop_token_ids": [stop], "return_token_ids": True}
    choice = post(url, json=body).json()["choices"][0]
    assert choice["token_ids"] == cut and choice["finish_reason"] == "stop"
    for bad in ([-1], ["a"], [10 ** 6], [1] * 300):
        err = error_of(post(url, json={"model": MODEL, "prompt": "hi", "stop_token_ids": bad}),
                       400)
        assert err["param"].split(".")[0] == "stop_token_ids", err   # ".0": which item
    assert_still_serving(url, app, offline)


# --- item 3: every failure in OpenAI's shape ---------------------------------------------------
@pytest.mark.parametrize("content,words", [
    (b'{"model": "tiny-llama", "prompt": "\xff\xfe hi"}', "not valid UTF-8"),
    (b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
     "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_unparseable_bodies_get_the_openai_error_shape(server, offline, content, words):
    url, app = server
    r = post(url, content=content, headers={"content-type": "application/json"})
    err = error_of(r, 400)
    assert words in err["message"] and err["type"] == "invalid_request_error"
    assert_still_serving(url, app, offline)


def test_unknown_route_wrong_method_and_crash_get_the_openai_error_shape(server, offline):
    url, app = server
    err = error_of(httpx.get(f"{url}/v1/nothing", timeout=30), 404)
    assert "/v1/nothing" in err["message"] and err["code"] == "not_found"
    err = error_of(httpx.get(f"{url}/v1/completions", timeout=30), 405)
    assert "GET" in err["message"] and "POST" in err["message"]
    llm = app.state.llm

    def broken(*a, **k):
        raise RuntimeError("a bug")

    llm.make_requests = broken
    try:
        err = error_of(post(url, json={"model": MODEL, "prompt": "hi"}), 500)
    finally:
        del llm.make_requests
    assert "RuntimeError" in err["message"] and err["type"] == "server_error"
    assert_still_serving(url, app, offline)


# --- item 9: --api-key ------------------------------------------------------------------------
def test_api_key_guards_everything_but_health(tiny, offline):
    key = "s3cret-key"
    llm = LLM(tiny, engine="paged", num_blocks=96)
    with running_server(llm, api_key=key) as (url, app):
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            err = error_of(post(url, json=body, headers=headers), 401)
            assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
            for path in ("/metrics", "/dashboard", "/dashboard/events", "/v1/models"):
                error_of(httpx.get(f"{url}{path}", headers=headers, timeout=30), 401)
        error_of(httpx.get(f"{url}/dashboard/events?key=wrong", timeout=30), 401)
        error_of(post(url, content=b"x" * BIG), 401)       # no key: not a byte is read
        error_of(httpx.get(f"{url}/v1/completions?key={key}", timeout=30), 401)   # dashboard only
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert post(url, json=body, headers=auth).status_code == 200
        assert httpx.get(f"{url}/metrics", headers=auth, timeout=30).status_code == 200
        page = httpx.get(f"{url}/dashboard?key={key}", timeout=30)
        assert page.status_code == 200 and 'get("key")' in page.text
        for query, headers in ((f"?key={key}", {}), ("", auth)):
            with httpx.stream("GET", f"{url}/dashboard/events{query}", headers=headers,
                              timeout=30) as r:
                assert r.status_code == 200
                assert next(r.iter_lines()).startswith("data: ")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        assert_still_serving(url, app, offline, api_key=key)


# --- item 6: a dead pipeline worker ------------------------------------------------------------
def test_dead_pipeline_worker_makes_health_503_and_requests_503(tiny, offline):
    # torch attention: a worker never waits for the C++ kernel to build (the default timeout
    # bounds every wait; a killed worker is noticed at once, its socket closed)
    llm = LLM(tiny, pipeline_parallel_size=2, num_blocks=256, attention_backend="torch")
    try:
        with running_server(llm, dashboard=False) as (url, app):
            c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=60, max_retries=0)
            want = offline.generate(["Hello there"], SamplingParams(max_tokens=8))[0].text
            assert c.completions.create(model=MODEL, prompt="Hello there", max_tokens=8,
                                        temperature=0).choices[0].text == want
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            stream = c.completions.create(model=MODEL, prompt="forever", max_tokens=3000,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            next(iter(stream))
            os.kill(llm.engine.group.processes[1].pid, signal.SIGKILL)
            with pytest.raises(openai.APIError, match="exited with code -9"):
                for _ in stream:
                    pass
            err = error_of(httpx.get(f"{url}/health", timeout=30), 503)
            assert "exited with code -9" in err["message"] and "restart" in err["message"]
            for _ in range(2):   # every new request, not only the next one
                with pytest.raises(openai.InternalServerError) as e:
                    c.completions.create(model=MODEL, prompt="hi", max_tokens=4)
                assert e.value.status_code == 503 and e.value.body["code"] == "engine_failed"
                assert "restart the server" in e.value.body["message"]
                assert "exited with code -9" in e.value.body["message"]
            bm = llm.engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks and not app.state.loop.handles
    finally:
        llm.engine.close()


def test_an_engine_that_fails_to_warm_up_stops_the_start_with_its_reason(tiny, monkeypatch):
    """``EngineLoop.start`` waits for the loop thread's ``engine.warm_up`` (rung 14 compiles
    there): a failure there is the start's error, on the server's thread, with its reason (the
    server then never listens); the loop thread ends and the engine serves offline after it."""
    from minillm.serve.loop import EngineLoop

    llm = LLM(tiny, engine="paged")

    def broken():
        raise OSError("no C++ compiler on this machine")

    monkeypatch.setattr(llm.engine, "warm_up", broken)
    loop = EngineLoop(llm.engine)
    with pytest.raises(RuntimeError, match="failed to warm up: no C\\+\\+ compiler"):
        loop.start()
    wait_until(lambda: not loop.alive(), what="the loop thread to end")
    assert llm.generate(["Hello"], SamplingParams(max_tokens=3), progress=False)[0].token_ids


def test_pipeline_worker_dead_while_idle_is_seen_by_health_error(tiny):
    llm = LLM(tiny, pipeline_parallel_size=2, num_blocks=16, attention_backend="torch")
    try:
        assert llm.engine.health_error() is None
        proc = llm.engine.group.processes[1]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert "exited with code -9" in (llm.engine.health_error() or "")
    finally:
        llm.engine.close()


# --- item 8: serve's flags are checked before the model loads ---------------------------------
@pytest.mark.parametrize("flags,words", [
    (["--port", "99999"], "--port must be in 0..65535"),
    (["--port", "-1"], "--port must be in 0..65535"),
    (["--host", "192.0.2.1"], "cannot listen on --host 192.0.2.1"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--max-waiting", "0"], "--max-waiting must be >= 1"),
])
def test_bad_serve_flags_are_one_line_and_exit_2(monkeypatch, capsys, flags, words):
    from minillm.__main__ import main

    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(LLM, "__init__", no_load)
    port = ["--port", str(free_port())] if "--port" not in flags else []
    assert main(["serve", "--model", MODEL, *port, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_port_in_use_is_one_line_and_exit_2(monkeypatch, capsys):
    from minillm.__main__ import main
    from minillm.serve.cli import listen_socket

    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("model loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", MODEL, "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on --host 127.0.0.1 --port {port}" in err[0], err
    with listen_socket("127.0.0.1", 0) as sock:       # port 0: any free port
        assert sock.getsockname()[1] > 0


def test_serve_cli_on_port_0_with_a_key_from_the_environment():
    """The real command: port 0 (any free port, printed), the key from $MINILLM_API_KEY; Ctrl-C
    ends it with status 130 (interrupted), as it ends generate."""
    env = {**os.environ, "MINILLM_API_KEY": "env-key", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", MODEL,
                             "--port", "0", "--attention", "torch", "--no-dashboard"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    try:
        url = None
        for _ in range(10_000):   # until uvicorn says it is up (bounded by the queue timeout)
            line = lines.get(timeout=120)
            url = url or next(iter(re.findall(r"on (http://127\.0\.0\.1:\d+)", line)), None)
            if "Application startup complete" in line:
                break
        assert url and not url.endswith(":0"), url
        assert httpx.get(f"{url}/health", timeout=30).text == "ok"
        error_of(httpx.get(f"{url}/v1/models", timeout=30), 401)
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer env-key"}, timeout=30)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    assert rc == 130


# --- one huge number must not kill other people's requests ------------------------------------
HUGE = int("9" * 400)


def test_huge_integers_are_400s_naming_the_field_while_others_are_served(tiny, offline):
    """Under --policy score an unbounded 400-digit max_tokens would overflow the policy's float
    arithmetic inside the engine's step: a 500 for it, for every request in flight and for the
    next one. Every integer field is bounded at parse time: each is a 400 naming the field, a
    request in flight meanwhile gets the offline engine's tokens, and the next request works."""
    llm = LLM(tiny, engine="paged", num_blocks=96, max_num_seqs=16, policy="score")
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = offline.generate(["Hello there"], params)[0]
    with running_server(llm, max_waiting=64) as (url, app):
        paused, answered = threading.Event(), threading.Event()

        def hold(loop, out):
            """The engine thread, after a step that left the normal request mid-generation,
            waits until the hostile requests are answered: they certainly come while it runs."""
            if loop.handles and not answered.is_set():
                paused.set()
                answered.wait(60)

        app.state.loop.on_step.append(hold)
        result: dict = {}
        normal = threading.Thread(target=lambda: result.setdefault("r", post(url, json={
            "model": MODEL, "prompt": "Hello there", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})))
        normal.start()
        try:
            assert paused.wait(60), "the normal request never started"
            for field in ("max_tokens", "priority", "max_completion_tokens", "seed", "top_k"):
                for path in ("/v1/completions", "/v1/chat/completions"):
                    prompt = {"prompt": "x"} if path == "/v1/completions" else \
                        {"messages": [{"role": "user", "content": "x"}]}
                    r = post(url, path, json={"model": MODEL, **prompt, field: HUGE})
                    err = error_of(r, 400)
                    assert err["param"] == field and field in err["message"], err
            assert app.state.loop.handles, "the normal request is still in flight"
        finally:
            answered.set()
            normal.join(60)
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["choices"][0]["token_ids"] == want.token_ids
        assert_still_serving(url, app, offline)


# --- strict numbers, 404s that help -------------------------------------------------------------
@pytest.mark.parametrize("field,value,ok", [
    ("temperature", 1, True), ("temperature", 0.5, True), ("temperature", "1", False),
    ("temperature", True, False), ("top_p", 1, True), ("top_p", "0.9", False),
    ("presence_penalty", False, False), ("frequency_penalty", "0", False), ("min_p", True, False),
    ("repetition_penalty", "1.1", False), ("ttft_slo_ms", "5", False), ("ttft_slo_ms", 5, True),
    ("max_tokens", 4, True), ("max_tokens", "4", False), ("max_tokens", True, False),
    ("max_tokens", 4.0, False), ("seed", True, False),
])
def test_number_fields_take_json_numbers_only(server, field, value, ok):
    """A float field takes what OpenAI's schema calls a number (a JSON integer or float), an
    integer field a JSON integer: never a string or a bool, which is a 400 naming the field."""
    url, app = server
    r = post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value})
    if ok:
        assert r.status_code == 200, r.text
    else:
        err = error_of(r, 400)
        assert err["param"] == field and field in err["message"], err
    r = post(url, "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, field: value,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == (200 if ok else 400), r.text
    r = post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                        "logit_bias": {"5": value}})
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        assert error_of(r, 400)["param"] == "logit_bias.5"


def test_an_unknown_route_lists_every_route_and_an_unknown_model_is_a_404(server):
    url, app = server
    err = error_of(httpx.get(f"{url}/v1/nothing", timeout=30), 404)
    for route in app.routes:
        assert route.path in err["message"], (route.path, err["message"])
    assert "POST /v1/chat/completions" in err["message"] and "GET /health" in err["message"]
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        err = error_of(post(url, path, json={"model": "gpt-4", **body}), 404)
        assert err["param"] == "model" and err["code"] == "model_not_found", err
        assert "'gpt-4' does not exist" in err["message"] and MODEL in err["message"]
