"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP.

Every answer is checked against the offline ``LLM.generate`` of the same request (same model, a
separate engine): the server adds a transport, never different tokens. Also: disconnects free
their KV blocks, the waiting queue is bounded (429, never a crash), bad bodies get a 400 naming
the field, an engine exception fails only the requests in flight, /metrics parses.
"""
from __future__ import annotations

import json
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import given, settings, strategies as st

from minillm import LLM, SamplingParams
from minillm.serve.detok import IncrementalDetokenizer
from serve_util import held_until_abort, offline, running_server, server, wait_until  # noqa: F401 (fixtures)

PROMPTS = ["Hello there", "The capital of France is", "1, 2, 3,", "Once upon a time",
           "def main():", "Q: why is the sky blue?\nA:", "<html>", "zzz", "a", "Tell me a story",
           "ключ", "東京", "42", "SELECT * FROM", "import torch", "The end."]



def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, **kw)


def pool_full(app) -> bool:
    bm = app.state.loop.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not app.state.loop.handles


def offline_texts(offline, prompts, **params) -> list[str]:
    return [o.text for o in offline.generate(list(prompts), SamplingParams(**params))]


def test_greedy_stream_equals_nonstream_equals_offline(server, offline):
    url, app = server
    c = client(url)
    for prompt in PROMPTS[:4]:
        want = offline_texts(offline, [prompt], max_tokens=24)[0]
        full = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24,
                                    temperature=0)
        chunks = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24,
                                      temperature=0, stream=True)
        streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert full.choices[0].text == streamed == want
        assert full.usage.completion_tokens == 24 and full.choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "Hi!"}]
    want = offline_texts(offline, [msgs], max_tokens=16)[0]
    chat = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=16,
                                     temperature=0)
    chunks = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=16,
                                       temperature=0, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chat.choices[0].message.content == streamed == want
    wait_until(lambda: pool_full(app), what="the pool back to full")


def test_sixteen_concurrent_streams_equal_offline(server, offline):
    url, app = server
    want = offline_texts(offline, PROMPTS, max_tokens=32)
    c = client(url)
    start = threading.Barrier(len(PROMPTS))

    def stream(prompt: str) -> tuple[str, int]:
        start.wait(timeout=30)
        chunks = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=32,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True})
        text, tokens = "", None
        for ch in chunks:
            text += "".join(x.text for x in ch.choices)
            tokens = ch.usage.completion_tokens if ch.usage else tokens
        return text, tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(stream, PROMPTS))
    assert [t for t, _ in got] == want
    assert all(n == 32 for _, n in got)
    wait_until(lambda: pool_full(app), what="the pool back to full")


def test_sampling_n_seed_and_stop_strings(server, offline):
    url, _ = server
    c = client(url)
    params = dict(max_tokens=20, temperature=0.9, top_p=0.95, seed=7, n=2)
    out = offline.generate(["Once upon a time"], SamplingParams(**params))[0]
    want = [offline.tokenizer.decode(s, skip_special_tokens=True) for s in out.samples]
    full = c.completions.create(model="tiny-llama", prompt="Once upon a time", **params)
    assert [ch.text for ch in sorted(full.choices, key=lambda x: x.index)] == want
    streamed = ["", ""]
    for ch in c.completions.create(model="tiny-llama", prompt="Once upon a time", stream=True,
                                   **params):
        for x in ch.choices:
            streamed[x.index] += x.text
    assert streamed == want
    # a stop string taken from the middle of the greedy answer cuts it there, streamed or not
    greedy = offline_texts(offline, ["Hello there"], max_tokens=40)[0]
    stop = next(greedy[i:i + 2] for i in range(4, len(greedy) - 2)
                if "\ufffd" not in greedy[i:i + 2])
    cut = greedy[:greedy.find(stop)]
    kw = dict(model="tiny-llama", prompt="Hello there", max_tokens=40, temperature=0, stop=[stop])
    full = c.completions.create(**kw)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw)
                       if ch.choices)
    assert full.choices[0].text == streamed == cut
    assert full.choices[0].finish_reason == "stop"


TEXT = st.text(alphabet=st.sampled_from("ab ,é€😀\ufffd"), max_size=24)


@settings(max_examples=150, deadline=None)
@given(text=TEXT, stops=st.lists(st.text(alphabet=st.sampled_from("ab é€😀\ufffd"),
                                         min_size=1, max_size=4), max_size=3),
       chunk=st.integers(1, 4))
def test_incremental_detokenizer_streams_the_text_up_to_the_first_stop(tiny, text, stops, chunk):
    """Fed a few byte-tokens at a time (multi-byte characters split across tokens), what is handed
    out is the text up to where a stop string begins (the first to complete, as in vLLM), holds no
    stop string, and is never taken back; with no stop string in the text, all of it."""
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tiny.tokenizer, stops)
    sent = "".join(d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)) + d.flush()
    assert sent == d.text and text.startswith(sent)
    assert not any(s in sent for s in stops)
    if d.stopped:
        assert any(text[len(sent):].startswith(s) for s in stops)
    else:
        assert sent == text and not any(s in text for s in stops)


def test_disconnect_mid_stream_frees_blocks(server):
    url, app = server
    loop = app.state.loop
    before = loop.metrics.finished.get("abort", 0)
    with held_until_abort(loop):        # it cannot end before we hang up
        stream = client(url).completions.create(model="tiny-llama", prompt="Never ending",
                                                max_tokens=1200, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True})
        got = 0
        for ch in stream:
            got += 1
            if got == 5:
                break
        assert not pool_full(app), "the request should hold blocks while it streams"
        stream.close()
    wait_until(lambda: pool_full(app), what="the aborted request's blocks back in the pool")
    assert loop.metrics.finished.get("abort", 0) == before + 1


def test_non_streaming_client_that_gives_up_frees_blocks(server):
    """A non-streamed request has no stream to cancel: the handler must notice the client left."""
    url, app = server
    before = app.state.loop.metrics.finished.get("abort", 0)
    body = {"model": "tiny-llama", "prompt": "long", "max_tokens": 1200, "ignore_eos": True}
    with held_until_abort(app.state.loop), pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    wait_until(lambda: pool_full(app), what="the abandoned request's blocks back in the pool")
    assert app.state.loop.metrics.finished.get("abort", 0) == before + 1


def test_dynamic_engine_serves_too(tiny, offline):
    with running_server(LLM(tiny, engine="dynamic", max_num_seqs=4), dashboard=True) as (url, _):
        c = client(url)
        full = c.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=16,
                                    temperature=0)
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny-llama", prompt="Hello there", max_tokens=16, temperature=0, stream=True)
            if ch.choices)
        assert full.choices[0].text == streamed == offline_texts(offline, ["Hello there"],
                                                                 max_tokens=16)[0]
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny-llama", prompt="hi", n=2, max_tokens=4)
        assert e.value.body["param"] == "n"


@pytest.mark.parametrize("body,param", [
    ({"model": "tiny-llama", "prompt": "hi", "max_tokens": -1}, "max_tokens"),   # 0: echo only
    ({"model": "tiny-llama", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "tiny-llama"}, "prompt"),
    ({"model": "tiny-llama", "prompt": "hi", "n": 0}, "n"),
    ({"model": "tiny-llama", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "tiny-llama", "prompt": "", "max_tokens": 4}, "prompt"),
    ({"model": "tiny-llama", "prompt": [1, 99999]}, "prompt"),
    ({"model": "tiny-llama", "prompt": "hi", "max_tokens": 10 ** 6}, "max_tokens"),
    ({"model": "tiny-llama", "prompt": "hi", "logprobs": 21}, "logprobs"),     # vLLM's cap: 20
    ({"model": "tiny-llama", "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": "tiny-llama", "prompt": [True, 5]}, "prompt"),          # no lax coercions
    ({"model": "tiny-llama", "prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    ({"model": "tiny-llama", "prompt": "hi", "stream": "yes"}, "stream"),
    ({"model": "tiny-llama", "prompt": ["a", "b"]}, "prompt"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_malformed_body_gets_400(server):
    url, _ = server
    for content in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(f"{url}/v1/chat/completions", content=content, timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    lone_surrogate = rb'{"model": "tiny-llama", "prompt": "\ud800"}'   # valid JSON, bad text
    r = httpx.post(f"{url}/v1/completions", content=lone_surrogate, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    for messages, param in (([], "messages"), ([{"role": "wizard", "content": "hi"}],
                                               "messages.0.role"),
                            ([{"role": "user"}], "messages.0.content")):
        with pytest.raises(openai.BadRequestError) as e:
            client(url).chat.completions.create(model="tiny-llama", messages=messages,
                                                max_tokens=4)
        assert e.value.body["param"] == param
    # OpenAI's content parts (text) are the same prompt as a plain string
    c = client(url)
    parts = c.chat.completions.create(model="tiny-llama", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                     {"type": "text", "text": "you"}]}])
    plain = c.chat.completions.create(model="tiny-llama", max_tokens=6, temperature=0,
                                      messages=[{"role": "user", "content": "Hi you"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_overload_gets_429_and_accepted_requests_finish_once(tiny):
    llm = LLM(tiny, engine="paged", num_blocks=96, max_num_seqs=2)
    with running_server(llm, max_waiting=2, dashboard=False) as (url, app):
        c = client(url, max_retries=0)
        start = threading.Barrier(12)

        def call(i: int):
            start.wait(timeout=30)
            try:
                r = c.completions.create(model="tiny-llama", prompt=f"request {i}",
                                         max_tokens=400, temperature=0,
                                         extra_body={"ignore_eos": True})
                return r.id, r.usage.completion_tokens
            except openai.RateLimitError as e:
                assert e.body["code"] == "queue_full"
                return None

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(call, range(12)))
        accepted = [r for r in results if r is not None]
        assert 0 < len(accepted) < 12
        assert all(n == 400 for _, n in accepted)
        assert len({rid for rid, _ in accepted}) == len(accepted)
        m = app.state.loop.metrics
        assert sum(m.finished.values()) == len(accepted) and m.rejected == 12 - len(accepted)
        wait_until(lambda: pool_full(app), what="the pool back to full")


def test_engine_exception_fails_in_flight_and_server_recovers(tiny, offline):
    """A step that raises fails the requests in flight (500 with the message), the pool is
    given back, and the next request is served as if nothing happened; a hook that raises
    after every step changes nothing."""
    llm = LLM(tiny, engine="paged", num_blocks=96)
    with running_server(llm, dashboard=False) as (url, app):
        engine, real_step, calls = llm.engine, llm.engine.step, Counter()

        def flaky_step():
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected failure")
            return real_step()

        engine.step = flaky_step

        def broken_hook(loop, out):   # a dashboard bug: logged, never fatal
            raise ValueError("hook bug")

        app.state.loop.on_step.append(broken_hook)
        c = client(url, max_retries=0)
        with pytest.raises(openai.InternalServerError, match="injected failure"):
            c.completions.create(model="tiny-llama", prompt="boom", max_tokens=10, temperature=0)
        wait_until(lambda: pool_full(app), what="the pool back to full after the failure")
        r = c.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=12,
                                 temperature=0)
        assert r.choices[0].text == offline_texts(offline, ["Hello there"], max_tokens=12)[0]
        assert app.state.loop.num_engine_errors == 1


METRIC_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def test_metrics_parse_with_vllm_names(server):
    url, app = server
    client(url).completions.create(model="tiny-llama", prompt="count", max_tokens=5,
                                   temperature=0)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = METRIC_LINE.match(line)
        assert m, f"not Prometheus text: {line!r}"
        samples[m[1] + (m[2] or "")] = float(m[3])
    names = {k.split("{")[0] for k in samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_sum"):
        assert name in names, name
    finished = sum(v for k, v in samples.items() if k.startswith("vllm:request_success_total"))
    ttft_n = samples['vllm:time_to_first_token_seconds_count{model_name="tiny-llama"}']
    assert ttft_n == finished >= 1
    assert 0.0 <= samples['vllm:kv_cache_usage_perc{model_name="tiny-llama"}'] <= 1.0
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    assert httpx.get(f"{url}/health", timeout=30).text == "ok"
    json.dumps(models)


def test_load_generator_against_the_server(server, tmp_path):
    """``bench --serve`` end to end (CLI parsing included): Poisson arrivals, every request
    completes, the token counts are the server's, the report carries vllm bench serve's keys."""
    from minillm.__main__ import main

    url, app = server
    before = sum(app.state.loop.metrics.finished.values())
    out = tmp_path / "serve_bench.json"
    rc = main(["bench", "--serve", url, "--model", "tiny-llama", "--rate", "40", "--requests",
               "12", "--concurrency", "6", "--max-tokens", "16", "--ignore-eos", "--json",
               str(out)])
    assert rc == 0
    m = json.loads(out.read_text())
    assert m["completed"] == 12 and m["failed"] == 0
    assert m["total_output_tokens"] == 12 * 16
    assert sum(app.state.loop.metrics.finished.values()) == before + 12
    for key in ("request_throughput", "output_throughput", "p50_ttft_ms", "p95_ttft_ms",
                "p99_ttft_ms", "p50_tpot_ms", "p99_itl_ms", "median_itl_ms"):
        assert m[key] > 0, key
    assert m["p50_ttft_ms"] <= m["p95_ttft_ms"] <= m["p99_ttft_ms"]
    assert main(["bench", "--max-tokens", "8"]) == 2          # a --serve flag without --serve
    assert main(["bench", "--serve", url, "--requests", "0"]) == 2


def test_shutdown_ends_open_streams_with_an_error(tiny):
    """Stopping the server (Ctrl-C does the same) ends a stream in flight with an OpenAI-style
    error event at once, instead of waiting for the request to finish."""
    llm = LLM(tiny, engine="paged", num_blocks=300)
    with running_server(llm, dashboard=False) as (url, app):
        stream = client(url, max_retries=0).completions.create(
            model="tiny-llama", prompt="forever", max_tokens=4000, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        next(iter(stream))
        app.state.server.stop()
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        wait_until(lambda: not app.state.loop.alive(), what="the loop to stop")
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not app.state.loop.handles


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_carry_token_ids(server, offline, path):
    """``return_token_ids`` with ``stream``: each chunk carries the ids it brought, even while a
    possible stop string holds its text back; they add up to the offline engine's tokens, the
    text to its text, for every sample."""
    url, app = server
    chat = "chat" in path
    prompt = [{"role": "user", "content": "Once"}] if chat else "Once upon a time"
    want = offline.generate([prompt], SamplingParams(max_tokens=20, n=2, seed=7,
                                                     temperature=0.8))[0]
    # a stop string whose first character the answer contains: the text before it is held back
    # (it might start the stop string) while its token ids are already sent
    texts = [offline.tokenizer.decode(s, skip_special_tokens=True) for s in want.samples]
    held = next(ch for ch in texts[0] if ch != "\ufffd")
    body = {"model": "tiny-llama", "max_tokens": 20, "n": 2, "seed": 7, "temperature": 0.8,
            "stream": True, "return_token_ids": True, "stop": [held + "\u0000"],
            ("messages" if chat else "prompt"): prompt}
    ids, text = {0: [], 1: []}, {0: "", 1: ""}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                if chat and c["delta"].get("role"):
                    assert "token_ids" not in c or c["token_ids"] == []
                    continue
                assert isinstance(c["token_ids"], list)
                ids[c["index"]] += c["token_ids"]
                text[c["index"]] += c["delta"].get("content", "") if chat else c["text"]
    assert [ids[0], ids[1]] == want.samples
    assert [text[0], text[1]] == texts
