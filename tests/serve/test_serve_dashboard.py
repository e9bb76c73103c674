"""The dashboard's frames (``serve/dashboard.py``), checked where the server builds and sends them
(the page itself is driven in a real browser by ``test_serve_browser.py``): a page opened late
gets the engine's current state, never a frame from before it came; the header's waiting count
is the length of the waiting list the page draws, requests the loop accepted but the engine has
not yet taken included; lines for features that are off are hidden by the page.
"""
from __future__ import annotations

import asyncio
import json
import re

import httpx

from minillm import LLM, SamplingParams
from minillm.serve.dashboard import PAGE, Dashboard
from minillm.serve.loop import EngineLoop
from serve_util import running_server

MODEL = "tiny-llama"


def first_frame(url: str) -> dict:
    with httpx.stream("GET", f"{url}/dashboard/events", timeout=60) as r:
        for line in r.iter_lines():           # bounded by the stream's timeout and its end
            if line.startswith("data: "):
                return json.loads(line[6:])
    raise AssertionError("the event stream ended without a frame")


def test_a_dashboard_opened_late_gets_the_current_state(tiny):
    """Nobody watched while a request ran: the frame built when the server started (step 0) is
    stale, and the first frame a late page gets is the engine's state now."""
    llm = LLM(tiny, engine="paged", num_blocks=64)
    with running_server(llm) as (url, app):
        body = {"model": MODEL, "prompt": "count to ten", "max_tokens": 6, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        steps = app.state.loop.step_count       # the engine is idle now: it stays
        assert steps > 0
        frame = first_frame(url)
        assert frame["step"] == steps and frame["stats"]["finished"] == 1
        assert frame["running"] == [] and frame["stats"]["num_running"] == 0


def test_the_waiting_count_is_the_waiting_list_arrivals_included(tiny):
    """Two requests in the engine's queue and three the loop accepted that join the engine at
    its next step: the header says 5 and the list shows all 5, the accepted ones as arriving."""
    llm = LLM(tiny, engine="paged", num_blocks=64)
    loop = EngineLoop(llm.engine, max_waiting=16)      # not started: its engine is ours to read
    board = Dashboard(loop, llm.tokenizer)
    queued = llm.make_requests(["one", "two"], SamplingParams(max_tokens=4))
    accepted = llm.make_requests(["three", "four", "five"], SamplingParams(max_tokens=4))
    for req in queued:
        llm.engine.add_request(req)

    async def submit():
        for req in accepted:
            loop.submit(req)
    asyncio.run(submit())
    try:
        board.build(0.0)
        frame = board.frame
        assert frame["stats"]["num_waiting"] == len(frame["waiting"]) == loop.num_waiting() == 5
        assert [(r["id"], r.get("stage")) for r in frame["waiting"]] == \
            [(r.request_id, None) for r in queued] + [(r.request_id, "arriving") for r in accepted]
        assert frame["stats"]["num_running"] == len(frame["running"]) == 0
    finally:
        llm.engine.reset()


def test_lines_of_features_that_are_off_are_hidden(tiny):
    """The frame of an engine without the batch controller or KV transfers has neither, and the
    page hides their lines: ``hidden`` set from the frame, and a stylesheet rule that keeps a
    hidden element hidden where another rule gives it a display (``.stats span``)."""
    with running_server(LLM(tiny, engine="paged", num_blocks=64)) as (url, _):
        frame = first_frame(url)
        page = httpx.get(f"{url}/dashboard", timeout=30).text
    assert "controller" not in frame and "transfers" not in frame
    assert re.search(r"\[hidden\]\s*\{\s*display:\s*none\s*!important;?\s*\}", page)
    assert '$("ctl").hidden = !f.controller' in page and '$("moved").hidden = !f.transfers' in page
    for element in ("ctl", "moved"):
        assert re.search(rf'<span id="{element}" hidden>', PAGE.read_text())
