"""What the server does before a handler runs, as ``python -m minillm serve`` assembles it
(``serve/cli.py``'s ``server_config``, ``serve/guard.py``): it answers only to its own host names
(DNS rebinding gets 421), closes connections that never finish their request head (slowloris),
serves at most ``--max-connections`` at once; and its flags are refused, with one ``error:`` line
naming the flag and the value, before the model loads.

No test here reads the clock: a connection closed by the server is seen as ``recv`` returning
b'' (under a generous socket timeout that only bounds a failing test), and the order of events
comes from the protocol (a ``100 Continue`` proves the server has read a request head).
"""
from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager

import httpx
import pytest

from minillm import LLM
from minillm.serve.app import StoppingServer, create_app
from minillm.serve.cli import check_args, listen_socket, server_config
from minillm.serve.guard import allowed_hosts, host_name
from serve_util import free_port, wait_until

MODEL = "tiny-llama"
LOOPBACK = {"127.0.0.1", "localhost", "[::1]"}
RECV_BOUND_S = 30      # bounds a socket read of a failing test; never an assertion on time


def serve_args(*flags: str):
    from minillm.__main__ import build_parser
    return build_parser().parse_args(["serve", "--model", MODEL, "--port", "0", *flags])


@contextmanager
def cli_server(tiny, *flags: str):
    """Yield ``(base_url, server)`` for ``create_app`` behind what ``serve *flags`` adds to it,
    on 127.0.0.1 at a free port, in a thread (as ``serve_util.running_server``)."""
    args = serve_args(*flags)
    assert check_args(args) is None
    app = create_app(LLM(tiny, engine="paged", num_blocks=64, max_num_seqs=4))
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = StoppingServer(server_config(app, args, port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, "the server to start")
        assert server.started, "the test server did not start"
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.stop()
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"


def connect(url: str, data: bytes = b"") -> socket.socket:
    port = int(url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=RECV_BOUND_S)
    if data:
        s.sendall(data)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never
    does within the bound: the test fails)."""
    got = b""
    for _ in range(10_000):
        chunk = s.recv(65536)
        if not chunk:
            return got
        got += chunk
    raise AssertionError("the server kept sending")


def read_until(s: socket.socket, marker: bytes) -> bytes:
    got = b""
    for _ in range(10_000):
        if marker in got:
            return got
        chunk = s.recv(65536)
        assert chunk, f"the server closed the connection before sending {marker!r}: {got!r}"
        got += chunk
    raise AssertionError(f"never got {marker!r}")


# --- Host (DNS rebinding) ---------------------------------------------------------------------
def test_allowed_hosts_are_the_servers_names_unless_widened():
    assert allowed_hosts("127.0.0.1") == LOOPBACK
    assert allowed_hosts("::1") == LOOPBACK
    assert allowed_hosts("192.168.1.5") == LOOPBACK | {"192.168.1.5"}
    assert allowed_hosts("127.0.0.1", "Proxy.example:8443, [fe80::1]") == \
        LOOPBACK | {"proxy.example", "[fe80::1]"}
    assert allowed_hosts("127.0.0.1", "*") is None
    # every interface: any name is expected, unless --allowed-hosts names them
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None
    assert allowed_hosts("0.0.0.0", "lab.example") == LOOPBACK | {"lab.example"}
    assert [host_name(h) for h in ("LocalHost.:8000", "[::1]:8000", "::1", "a.example")] == \
        ["localhost", "[::1]", "[::1]", "a.example"]
    for bad in ("", " , ", "a b", "http://a.example", "user@a.example", "a.example:port"):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            allowed_hosts("127.0.0.1", bad)


def misdirected(r: httpx.Response) -> None:
    assert r.status_code == 421, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == "misdirected_request" and "--allowed-hosts" in error["message"]


def test_only_the_servers_own_host_names_are_served(tiny):
    """A key-less server on 127.0.0.1: a page that rebinds attacker.example to 127.0.0.1 sends
    ``Host: attacker.example`` and must get 421 on the API and the dashboard; the names the
    server listens as, with or without a port, are served; --allowed-hosts adds names."""
    with cli_server(tiny, "--allowed-hosts", "proxy.example") as (url, _):
        port = url.rsplit(":", 1)[1]
        for path in ("/v1/models", "/dashboard"):
            for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"localhost:{port}",
                         f"[::1]:{port}", "proxy.example", f"proxy.example:{port}"):
                r = httpx.get(f"{url}{path}", headers={"Host": host}, timeout=30)
                assert r.status_code == 200, (path, host, r.text)
            for host in ("attacker.example", f"attacker.example:{port}",
                         "127.0.0.1.attacker.example", "localhost.attacker.example"):
                misdirected(httpx.get(f"{url}{path}", headers={"Host": host}, timeout=30))
        misdirected(httpx.post(f"{url}/v1/completions", headers={"Host": "attacker.example"},
                               json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                               timeout=30))


def test_host_is_checked_before_the_key(tiny):
    with cli_server(tiny, "--api-key", "k3y") as (url, _):
        misdirected(httpx.get(f"{url}/v1/models", timeout=30,
                              headers={"Host": "attacker.example", "Authorization": "Bearer k3y"}))
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert r.status_code == 200


# --- slowloris -----------------------------------------------------------------------------------
HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def test_connections_stalled_in_their_head_are_closed_and_others_served(tiny):
    """Stalled connections (nothing sent, half a request line, headers never ended, a keep-alive
    connection whose next request stops halfway) are closed by the server after
    --header-timeout-s; a normal request is served meanwhile."""
    with cli_server(tiny, "--header-timeout-s", "0.2") as (url, _):
        stalled = [connect(url), connect(url, b"GET /v1/mo"),
                   connect(url, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: 1\r\n")]
        again = connect(url, HEAD)
        assert read_until(again, b"\r\n\r\nok").startswith(b"HTTP/1.1 200")
        again.sendall(b"GET /health HTTP/1.1\r\nHo")          # its next request stalls
        stalled.append(again)
        try:
            r = httpx.get(f"{url}/v1/models", timeout=30)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
            for s in stalled:
                assert read_until_closed(s) == b""
        finally:
            for s in stalled:
                s.close()


def test_a_slow_body_is_not_cut_once_the_head_is_in(tiny):
    """The bound is on the request head only: a request whose head arrived (the server answers
    ``100 Continue``) may send its body after a stalled connection opened later was closed."""
    body = json.dumps({"model": MODEL, "prompt": "hello"}).encode()
    with cli_server(tiny, "--header-timeout-s", "0.2") as (url, _):
        slow = connect(url, b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
                            b"Content-Length: %d\r\n\r\n" % len(body))
        try:
            assert read_until(slow, b"\r\n\r\n").startswith(b"HTTP/1.1 100")
            with connect(url, b"GET /he") as stalled:       # opened after slow's head was read
                assert read_until_closed(stalled) == b""
            slow.sendall(body)
            answer = read_until(slow, b"}")
            assert answer.startswith(b"HTTP/1.1 200") and b'"tokens"' in answer, answer
        finally:
            slow.close()


def test_at_most_max_connections_are_served(tiny):
    with cli_server(tiny, "--max-connections", "2") as (url, server):
        held = [connect(url), connect(url)]
        try:
            wait_until(lambda: len(server.server_state.connections) == 2, 30,
                       "the server to accept both connections")
            assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        finally:
            for s in held:
                s.close()
        wait_until(lambda: not server.server_state.connections, 30, "the connections to close")
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200


# --- serve's flags: refused before the model loads --------------------------------------------
@pytest.mark.parametrize("flags,words", [
    (["--header-timeout-s", "0"], ("--header-timeout-s must be in (0, 3600] seconds", "got 0.0")),
    (["--header-timeout-s", "nan"], ("--header-timeout-s must be in (0, 3600]", "got nan")),
    (["--header-timeout-s", "1e9"], ("--header-timeout-s must be in (0, 3600]",
                                     "got 1000000000.0")),
    (["--max-connections", "0"], ("--max-connections must be >= 1", "got 0")),
    (["--grammar-timeout-s", "0"], ("--grammar-timeout-s must be in (0, 3600]", "got 0.0")),
    (["--grammar-timeout-s", "inf"], ("--grammar-timeout-s must be in (0, 3600]", "got inf")),
    (["--allowed-hosts", ""], ("--allowed-hosts must name at least one host (or *)", "got ''")),
    (["--allowed-hosts", "a.example,http://b"], ("--allowed-hosts item 'http://b'",)),
    (["--tpot-target-ms", "1e-300"], ("--tpot-target-ms must be >= 0.1 ms", "got 1e-300")),
    (["--tpot-target-ms", "0.05"], ("--tpot-target-ms must be >= 0.1 ms", "got 0.05")),
    (["--tpot-target-ms", "nan"], ("--tpot-target-ms must be >= 0.1 ms", "got nan")),
])
def test_bad_guard_flags_are_one_line_and_exit_2(monkeypatch, capsys, flags, words):
    from minillm.__main__ import main

    monkeypatch.setattr(LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--model", MODEL, "--port", str(free_port()), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert all(w in err[0] for w in words), err


def test_a_tpot_target_below_any_step_is_refused_by_the_engine_config():
    """Every entry point (generate, the Python API) refuses it, not only serve's flag check:
    the controller would otherwise hold the batch at one token forever, silently."""
    from minillm.engines.r12_realtime.config import MIN_TPOT_TARGET_MS, RealtimeConfig

    for value in (1e-300, MIN_TPOT_TARGET_MS / 2):
        with pytest.raises(ValueError, match=rf"tpot_target_ms must be >= 0.1 ms.*{value!r}"):
            RealtimeConfig(batch_controller="tpot", tpot_target_ms=value)
    assert RealtimeConfig(tpot_target_ms=MIN_TPOT_TARGET_MS).tpot_target_ms == 0.1
