"""``python -m minillm serve``: load a model, build the engine, serve it over HTTP (uvicorn).

Every flag is checked, and the listening socket bound, before the model loads: a bad port, a
host this machine does not have or a port already taken is one ``error:`` line and exit status 2
at once, not a traceback after the load.
"""
from __future__ import annotations

import argparse
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
open the dashboard as /dashboard?key=KEY."""
KEY_ENV = "MINILLM_API_KEY"


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
    return None


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
    import uvicorn

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
    try:
        llm = LLM(args.model, engine=args.engine, dtype=args.dtype, **engine_options)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # an engine with worker processes (disagg's prefill worker) leaves their cores to them
    threads = max(1, threads - llm.engine.threads_in_workers)
    key = args.api_key or os.environ.get(KEY_ENV) or None
    try:
        app = create_app(llm, max_waiting=args.max_waiting, dashboard=not args.no_dashboard,
                         api_key=key, max_body_bytes=args.max_body_bytes, engine_threads=threads,
                         lora_modules=parse_lora_modules(args.lora_modules))
    except ValueError as e:          # a bad --lora-modules item or adapter
        print(f"error: {e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    base = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{port}"
    board = f" — dashboard: {base}/dashboard" + ("?key=..." if key else "")
    print(f"[minillm] serving {llm.model.name} ({llm.engine.name} engine) on {base}"
          f"{board if not args.no_dashboard else ''}"
          f"{' (API key required)' if key else ''}", file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=port, log_level="info",
                            timeout_graceful_shutdown=3)
    StoppingServer(config).run(sockets=[sock])
    return 0
