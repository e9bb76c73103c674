"""``python -m minillm serve``: load a model, build the engine, serve it over HTTP (uvicorn).

Every flag is checked, and the listening socket bound, before the model loads: a bad port, a
host this machine does not have or a port already taken is one ``error:`` line and exit status 2
at once, not a traceback after the load. The server answers only to its own host names
(``--allowed-hosts``), closes connections that do not send a request head in time
(``--header-timeout-s``) and serves at most ``--max-connections`` at once (``guard.py``).
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys

SERVE_HELP = """\
An OpenAI-compatible server: POST /v1/completions and /v1/chat/completions (streamed with
"stream": true), GET /v1/models, /health, /metrics (Prometheus, vLLM's metric names) and
/dashboard (the running batch and the KV blocks, live). Try it with
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi!"}]}'
or the openai client (base_url="http://127.0.0.1:8000/v1", api_key: --api-key's, or any).
With --api-key (or MINILLM_API_KEY) every route but /health needs "Authorization: Bearer KEY";
open the dashboard as /dashboard?key=KEY.
Only requests whose Host header names this server are answered (127.0.0.1, localhost, [::1] and
--host; any name with --host 0.0.0.0): another site's page that points its own name at 127.0.0.1
(DNS rebinding) gets 421. A proxy or tunnel that forwards its own name needs --allowed-hosts."""
KEY_ENV = "MINILLM_API_KEY"
HEADER_TIMEOUT_S = 10.0
# Far more than the engine serves at once (max_num_seqs running and --max-waiting waiting, each a
# connection, plus dashboards and scrapes), and below the usual 1,024 open files of a process.
MAX_CONNECTIONS = 512
MAX_TIMEOUT_S = 3600.0


def servable_engines() -> tuple[str, ...]:
    """The registry's engines marked servable: they must abort (a client may go away)."""
    from ..engines import REGISTRY
    return tuple(name for name, spec in REGISTRY.items() if spec.servable and spec.supports_abort)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="paged", choices=servable_engines(),
                   help="an engine that can abort requests (default: paged)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0..65535 (0: any free port)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests allowed to wait for the engine; beyond that: HTTP 429")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="bigger request bodies get HTTP 413 (default: 128 bytes per token of the "
                        "model's context, at least 1 MiB)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health "
                        f"(default: ${KEY_ENV} if set, else no key)")
    p.add_argument("--no-dashboard", action="store_true", help="do not serve /dashboard")
    p.add_argument("--allowed-hosts", default=None, metavar="HOST,...",
                   help="more host names the Host header may name (a proxy's, a tunnel's; '*': "
                        "any); always allowed: 127.0.0.1, localhost, [::1] and --host (any name "
                        "when --host is 0.0.0.0 or ::); other names get HTTP 421")
    p.add_argument("--header-timeout-s", type=float, default=HEADER_TIMEOUT_S,
                   help="close a connection that has not sent a whole request head (request "
                        f"line and headers) this many seconds after it began (default "
                        f"{HEADER_TIMEOUT_S:g})")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help="connections served at once; a request on one more gets HTTP 503 "
                        f"(default {MAX_CONNECTIONS})")
    p.add_argument("--grammar-timeout-s", type=float, default=None,
                   help="how long a request waits for its grammar (structured output) to compile "
                        "before it gets a 400; compiled grammars are cached (default 20, "
                        "serve/grammar.py says why)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=None,
                   help="LoRA adapters (PEFT's format) a request's model field may name; needs "
                        "--enable-lora (rung 13)")


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the serve flags (the message of an ``error:`` line), or None."""
    if args.max_waiting < 1:
        return f"--max-waiting must be >= 1, got {args.max_waiting}"
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535 (0: any free port), got {args.port}"
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        return f"--max-body-bytes must be >= 1, got {args.max_body_bytes}"
    if args.threads is not None and args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    if args.api_key is not None and not args.api_key.strip():
        return "--api-key must not be empty"
    if not (math.isfinite(args.header_timeout_s) and 0 < args.header_timeout_s
            <= MAX_TIMEOUT_S):
        return (f"--header-timeout-s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got "
                f"{args.header_timeout_s!r}")
    grammar_s = args.grammar_timeout_s
    if grammar_s is not None and not (math.isfinite(grammar_s) and 0 < grammar_s
                                      <= MAX_TIMEOUT_S):
        return (f"--grammar-timeout-s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got "
                f"{grammar_s!r}")
    if args.max_connections < 1:
        return f"--max-connections must be >= 1, got {args.max_connections}"
    from ..engines.r12_realtime.config import MIN_TPOT_TARGET_MS
    target = getattr(args, "tpot_target_ms", None)
    if target is not None and not target >= MIN_TPOT_TARGET_MS:    # NaN too
        return (f"--tpot-target-ms must be >= {MIN_TPOT_TARGET_MS:g} ms (no engine step is "
                f"faster: the batch would be held at one token), got {target!r}")
    from .guard import allowed_hosts
    try:
        allowed_hosts(args.host, args.allowed_hosts)
    except ValueError as e:
        return str(e)
    return None


def dtype_choice(requested: str) -> tuple[str, str]:
    """The dtype serve loads the model in (``--dtype``; ``auto`` as ``models.resolve_dtype``
    resolves it) and the one start-up line that says it, and for ``auto`` why."""
    from ..models import auto_dtype, default_device, dtype_name

    if requested != "auto":
        return requested, f"[minillm] dtype: {requested} (--dtype)"
    chosen, why = auto_dtype(default_device().type)
    return dtype_name(chosen), f"[minillm] dtype: auto -> {dtype_name(chosen)} ({why})"


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (OSError says why not); uvicorn listens on it later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET   # as uvicorn decides
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def main(args: argparse.Namespace, engine_options: dict) -> int:
    if (problem := check_args(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        sock = listen_socket(args.host, args.port)
    except (OSError, OverflowError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"error: cannot listen on --host {args.host} --port {args.port}: {why}",
              file=sys.stderr)
        return 2
    with sock:
        return run(args, engine_options, sock)


def run(args: argparse.Namespace, engine_options: dict, sock: socket.socket) -> int:
    import torch

    from ..llm import LLM
    from .app import StoppingServer, create_app
    from .lora import parse_lora_modules

    # The engine computes on the loop thread, not on this one. Each thread that runs torch work
    # on several cores gets its own OpenMP team, and once libgomp manages more threads than there
    # are cores its idle workers stop spinning and sleep: every later parallel op then wakes them
    # through the kernel. Measured on the lab CPU: a decode step ~25% slower, served TPOT ~2x
    # (`bench --serve minillm,offline`). So this thread loads the model on one thread (it never
    # makes a team) and the loop thread computes on all of them.
    threads = args.threads or max(1, min(torch.get_num_threads(), 8))
    torch.set_num_threads(1)
    dtype, line = dtype_choice(args.dtype)
    print(line, file=sys.stderr)
    try:
        llm = LLM(args.model, engine=args.engine, dtype=dtype, **engine_options)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # an engine with worker processes (disagg's prefill worker) leaves their cores to them
    threads = max(1, threads - llm.engine.threads_in_workers)
    key = args.api_key or os.environ.get(KEY_ENV) or None
    try:
        app = create_app(llm, max_waiting=args.max_waiting, dashboard=not args.no_dashboard,
                         api_key=key, max_body_bytes=args.max_body_bytes, engine_threads=threads,
                         lora_modules=parse_lora_modules(args.lora_modules),
                         **({} if args.grammar_timeout_s is None
                            else {"grammar_timeout_s": args.grammar_timeout_s}))
    except ValueError as e:          # a bad --lora-modules item or adapter
        print(f"error: {e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    base = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{port}"
    board = f" — dashboard: {base}/dashboard" + ("?key=..." if key else "")
    print(f"[minillm] serving {llm.model.name} ({llm.engine.name} engine) on {base}"
          f"{board if not args.no_dashboard else ''}"
          f"{' (API key required)' if key else ''}", file=sys.stderr)
    StoppingServer(server_config(app, args, port)).run(sockets=[sock])
    return 0


def server_config(app, args: argparse.Namespace, port: int, log_level: str = "info"):
    """uvicorn's config for ``app`` as serve's flags ask (checked by ``check_args``): the Host
    check (``guard.AllowedHosts``, outermost: a misdirected request is answered before the key is
    looked at), the request-head timeout and the connection cap (``guard.connection_limits``)."""
    import uvicorn

    from .guard import AllowedHosts, allowed_hosts, connection_limits

    hosts = allowed_hosts(args.host, args.allowed_hosts)
    if hosts is not None:
        app.add_middleware(AllowedHosts, hosts=hosts)
    return uvicorn.Config(app, host=args.host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=3,
                          **connection_limits(args.header_timeout_s, args.max_connections))
