"""Rung 11 served: ``python -m minillm serve --engine disagg`` is the same API as the paged engine
(outputs equal the offline paged engine's), /metrics counts each request's KV transfer (time and
bytes), the dashboard carries both pools, a client that hangs up frees blocks on both workers,
and a killed prefill worker is a 503 naming it, with every stream ended."""
from __future__ import annotations

import json
import os
import re
import signal
import threading

import httpx
import pytest

from minillm import LLM, SamplingParams
from minillm.lab.reference import random_prompts
from serve_util import held_until_abort, running_server, wait_until

# slow: a prefill worker process per server: not in make test-fast. One xdist group (`--dist loadgroup`): under
# `make test` (two xdist workers), two files of worker ranks at once (7 processes on 2 cores) once
# left a group unformed after 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ranks")]

OPTIONS = dict(num_blocks=600, block_size=4, max_num_seqs=8)


def pools_full(app) -> bool:
    eng = app.state.loop.engine
    free, total = eng.prefill_pool           # as the prefill worker's latest reply said
    kv = app.state.loop.kv
    return kv.allocated == 0 and free == total and not eng.has_unfinished()


def metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}{{model_name="tiny-llama"}} (\S+)$', text, re.M)
    assert m, f"{name} is not in /metrics"
    return float(m[1])


@pytest.fixture(scope="module")
def served(tiny):
    llm = LLM(tiny, engine="disagg", **OPTIONS)
    with running_server(llm) as (url, app):
        yield url, app
    llm.engine.close()


def test_outputs_equal_the_paged_engine_and_metrics_count_each_transfer(served, tiny):
    url, app = served
    prompts = random_prompts(6, seed=120, lo=5, hi=40)
    results = [None] * len(prompts)

    def send(i):
        body = {"model": "tiny-llama", "prompt": prompts[i], "max_tokens": 9, "temperature": 0,
                "ignore_eos": True}
        results[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    offline = LLM(tiny, engine="paged", **OPTIONS).generate(
        prompts, SamplingParams(max_tokens=9, ignore_eos=True))
    assert [r["choices"][0]["text"] for r in results] == [o.text for o in offline]
    wait_until(lambda: pools_full(app), what="both pools back to full")
    text = httpx.get(f"{url}/metrics", timeout=30).text
    # every prompt but its last token was computed on the prefill worker and moved as blocks
    eng = app.state.loop.engine
    moved = sum(-(-(len(p) - 1) // 4) * 4 * eng.kv_bytes_per_token for p in prompts)
    assert metric(text, "minillm:kv_transfer_bytes_count") >= len(prompts)
    assert metric(text, "minillm:kv_transfer_bytes_sum") >= moved
    assert metric(text, "minillm:kv_transfer_seconds_sum") > 0


def test_dashboard_frames_carry_both_pools(served):
    url, app = served
    body = {"model": "tiny-llama", "prompt": [5] * 30, "max_tokens": 20, "ignore_eos": True}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
    frames = []
    with httpx.stream("GET", f"{url}/dashboard/events", timeout=60) as r:
        for line in r.iter_lines():           # bounded: the test stops at the third frame
            if line.startswith("data: "):
                frames.append(json.loads(line[6:]))
                httpx.post(f"{url}/v1/completions", json=body, timeout=120)
                if len(frames) == 3:
                    break
    assert all("kv_prefill" in f for f in frames) and frames[-1]["transfers"]["requests"] >= 1
    pictures = [f["kv_prefill"] for f in frames if f["kv_prefill"] is not None]
    assert pictures, "the prefill worker never sent a picture of its pool"
    assert pictures[-1]["rows"] == app.state.loop.engine.prefill_pool[1]


def test_client_that_hangs_up_frees_blocks_on_both_workers(served):
    url, app = served
    body = {"model": "tiny-llama", "prompt": [7] * 25, "max_tokens": 2000, "stream": True,
            "ignore_eos": True, "seed": 1}     # (2025 tokens: 507 of the 600 blocks; seeded: a
    # random tiny model greedy repeats token 0, whose text is empty: no chunks)
    before = app.state.loop.metrics.finished.get("abort", 0)
    with held_until_abort(app.state.loop), \
            httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 5:
                break
        assert not pools_full(app), "the request should hold blocks while it streams"
    wait_until(lambda: pools_full(app), what="the hung-up request's blocks back in both pools")
    assert app.state.loop.metrics.finished.get("abort", 0) == before + 1


def test_killed_prefill_worker_is_a_503_naming_it(tiny):
    llm = LLM(tiny, engine="disagg", transfer_timeout_s=5, **OPTIONS)
    proc = llm.engine.group.processes[1]
    with running_server(llm) as (url, app):
        body = {"model": "tiny-llama", "prompt": [9] * 20, "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code in (500, 503), r.text
        assert "prefill worker rank 1" in r.text and "exited" in r.text
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503 and "prefill worker rank 1" in health.text
    llm.engine.close()
    assert not proc.is_alive()
