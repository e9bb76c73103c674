"""``python -m minillm serve``: load a model, build the engine, serve it over HTTP (uvicorn)."""
from __future__ import annotations

import argparse
import sys

SERVE_HELP = """\
An OpenAI-compatible server: POST /v1/completions and /v1/chat/completions (streamed with
"stream": true), GET /v1/models, /health, /metrics (Prometheus, vLLM's metric names) and
/dashboard (the running batch and the KV blocks, live). Try it with
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi!"}]}'
or the openai client (base_url="http://127.0.0.1:8000/v1", any api_key)."""


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="paged", choices=("paged", "dynamic"),
                   help="an engine that can abort requests (default: paged)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests allowed to wait for the engine; beyond that: HTTP 429")
    p.add_argument("--no-dashboard", action="store_true", help="do not serve /dashboard")


def main(args: argparse.Namespace, engine_options: dict) -> int:
    import torch
    import uvicorn

    from ..llm import LLM
    from .app import StoppingServer, create_app

    if args.max_waiting < 1:
        print(f"error: --max-waiting must be >= 1, got {args.max_waiting}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 8)))
    try:
        llm = LLM(args.model, engine=args.engine, **engine_options)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(llm, max_waiting=args.max_waiting, dashboard=not args.no_dashboard)
    print(f"[minillm] serving {llm.model.name} ({args.engine} engine) on "
          f"http://{args.host}:{args.port} — dashboard: http://{args.host}:{args.port}/dashboard",
          file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=3)
    StoppingServer(config).run()
    return 0
