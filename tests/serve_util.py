"""A minillm server on 127.0.0.1 at a free port, in a background thread, for the serving tests."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from minillm import LLM
from minillm.serve.app import StoppingServer, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(llm: LLM, **app_options):
    """Yield ``(base_url, app)`` while uvicorn serves ``create_app(llm)``; stop it afterwards
    (``app.state.server`` is the ``StoppingServer``, for tests that stop it themselves)."""
    app = create_app(llm, **app_options)
    port = free_port()
    server = StoppingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=5))
    app.state.server = server
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.stop()
        thread.join(30)
        assert not thread.is_alive(), "the test server did not stop"


@contextmanager
def held_until_abort(loop, after_tokens: int = 32, timeout_s: float = 60.0):
    """Hold the engine loop's thread, from the first step after which a request has been handed
    ``after_tokens`` tokens, until a handler calls ``loop.abort``: a hang-up test's request then
    cannot end before its client leaves, however busy the machine (under a loaded CI a
    2,000-token request once ended before its client had read 5 chunks). Leaving the block waits
    for that abort too. The hold is an ``on_step`` hook, the seam a dashboard uses; one never
    released ends after ``timeout_s`` and the test's own assertions fail."""
    aborted, held = threading.Event(), threading.Event()
    real_abort = loop.abort

    def abort(request_id: str) -> None:
        real_abort(request_id)          # in the inbox first: the loop reads it once released
        aborted.set()

    def hold(lp, out) -> None:
        if held.is_set() or not any(sum(h.sent.values()) >= after_tokens
                                    for h in lp.handles.values()):
            return
        held.set()
        aborted.wait(timeout_s)

    loop.abort = abort                  # an instance attribute: the class's method is untouched
    loop.on_step.append(hold)
    try:
        yield
        aborted.wait(timeout_s)         # the client has left: hold on until its handler notices
    finally:
        aborted.set()                   # never leave the loop held behind a failed test
        loop.on_step.remove(hold)
        del loop.abort


def wait_until(condition, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` (bounded in time and count); fail with ``what`` if it never holds."""
    deadline = time.monotonic() + timeout_s
    for _ in range(100_000):
        if condition():
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# The two fixtures the serving tests share (import them into a test module to use them).
@pytest.fixture(scope="module")
def offline(tiny):
    return LLM(tiny, engine="paged")


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(tiny, engine="paged", num_blocks=96, max_num_seqs=16)
    with running_server(llm, max_waiting=64) as (url, app):
        yield url, app
