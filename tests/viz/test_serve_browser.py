"""The serving dashboard in a real browser: headless Chromium (Debian's, driven by Selenium) opens
``/dashboard`` while streaming clients load the server, and must show it live: the running batch
(one row per request, growing token by token), the waiting queue (as many chips as the header's
count), the step counter moving, the KV pool filling, no line for the batch controller or KV
transfers (both off); and, once the clients hang up, everything back to empty.

The load is under the test's control (long requests that the clients close when the test is done
looking), so nothing here depends on how fast the machine is. With ``--api-key`` the page, opened
as ``/dashboard?key=KEY``, must forward the key to its event stream and go live. Screenshots land in
``$MINILLM_BROWSER_SHOTS`` (default: the test's tmp folder).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest

from minillm import LLM
from serve_util import running_server, wait_until
from test_browser import browser  # noqa: F401 - the headless Chromium fixture

pytestmark = pytest.mark.slow

MAX_NUM_SEQS, CLIENTS = 4, 6

DOM_STATE = """
const n = (id) => Number(document.getElementById(id).textContent);
return {status: document.getElementById('status').textContent, step: n('step'),
        rows: [...document.querySelectorAll('#running tr.req')].map(
            (tr) => Number(tr.children[3].textContent)),   // class, request, prompt, out
        waiting: document.querySelectorAll('#waiting .chip').length, nwait: n('nwait'),
        kv: document.getElementById('kvtitle').textContent, finished: n('nfin'),
        off: ['ctl', 'moved'].map((id) => getComputedStyle(document.getElementById(id)).display)};
"""


def stream_until(url: str, prompt: str, stop: threading.Event, seen: list,
                 headers: dict | None = None) -> None:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=60) as r:
        for line in r.iter_lines():
            seen.append(line)
            if stop.is_set():
                break   # hang up: the server must abort the request and free its blocks


def test_dashboard_updates_live(tiny, browser, tmp_path):  # noqa: F811
    shots = Path(os.environ.get("MINILLM_BROWSER_SHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    llm = LLM(tiny, engine="paged", num_blocks=1100, max_num_seqs=MAX_NUM_SEQS)
    with running_server(llm) as (url, app):
        browser.get(f"{url}/dashboard")
        state = lambda: browser.execute_script(DOM_STATE)  # noqa: E731
        wait_until(lambda: state()["status"] == "live", 30, "the page to connect")
        # "live" is the stream's open; the first frame (the idle engine's KV) follows it
        wait_until(lambda: " 0 token slots" in state()["kv"], 30, "the first frame")
        assert state()["rows"] == []
        assert state()["off"] == ["none", "none"]     # no controller, no transfers: no lines

        stop, seen = threading.Event(), []
        clients = [threading.Thread(target=stream_until, args=(url, f"client {i}", stop, seen))
                   for i in range(CLIENTS)]
        for t in clients:
            t.start()
        try:
            wait_until(lambda: len((s := state())["rows"]) == MAX_NUM_SEQS
                       and s["waiting"] == s["nwait"] == CLIENTS - MAX_NUM_SEQS, 30,
                       "a full running batch and the rest waiting")
            first = state()
            wait_until(lambda: state()["step"] > first["step"]
                       and max(state()["rows"]) > max(first["rows"]), 30,
                       "the step counter and the rows to grow")
            assert " 0 token slots" not in state()["kv"]
            (shots / "serve_dashboard.png").write_bytes(browser.get_screenshot_as_png())
        finally:
            stop.set()
            for t in clients:
                t.join(60)
        wait_until(lambda: not state()["rows"] and state()["waiting"] == 0
                   and " 0 token slots" in state()["kv"], 30,
                   "the batch, the queue and the pool empty after the clients hung up")
        assert state()["finished"] == CLIENTS     # every request ended exactly once (aborted)
        bm = app.state.loop.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        assert seen, "the clients received tokens"


def test_dashboard_with_api_key_passes_it_to_its_events(tiny, browser):  # noqa: F811
    """With --api-key the page is opened as /dashboard?key=KEY and its EventSource (which cannot
    send headers) forwards the key: the page goes live and shows a request's row."""
    llm = LLM(tiny, engine="paged", num_blocks=300, max_num_seqs=2)
    with running_server(llm, api_key="k3y") as (url, app):
        browser.get(f"{url}/dashboard")
        assert "invalid_api_key" in browser.page_source        # no key: the 401 body
        browser.get(f"{url}/dashboard?key=k3y")
        state = lambda: browser.execute_script(DOM_STATE)  # noqa: E731
        wait_until(lambda: state()["status"] == "live", 30, "the page to connect with the key")
        stop, seen = threading.Event(), []
        client = threading.Thread(target=stream_until, args=(url, "keyed", stop, seen,
                                                             {"Authorization": "Bearer k3y"}))
        client.start()
        try:
            wait_until(lambda: len(state()["rows"]) == 1, 30, "the request's row")
        finally:
            stop.set()
            client.join(60)
        wait_until(lambda: not state()["rows"], 30, "the batch empty after the client hung up")
