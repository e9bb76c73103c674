"""Command line: ``python -m minillm generate ...``, ``python -m minillm bench ...`` and
``python -m minillm serve ...`` (an OpenAI-compatible server, ``minillm/serve/``)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from .jsonl import Line, output_row, read_lines, write_rows

# Only the standard library above (jsonl.py imports no more): the engines and torch (~2 s) load
# inside ``main``, after it has taken over Ctrl-C, SIGTERM and SIGHUP, so a signal at any moment
# ends the way it should.

GENERATE_HELP = """\
Generate for every non-blank line of a UTF-8 JSONL file (a leading BOM is ignored): an object with
one of "prompt", "messages", "prompt_token_ids", and optionally "id", "max_tokens", "temperature",
"top_p", "top_k", "seed", "n", "beam_width", "priority", "ignore_eos", the sampler's controls
("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
"logit_bias": {"token id": bias}) and "lora" (an adapter of --lora-modules, with --enable-lora:
rung 13). --out gets one line per
input line, in order: a result, or {"id", "error"}; it is replaced atomically, never left
half-written. Exit status: 0 all ok, 1 some lines failed (also when the engine itself fails
mid-run, e.g. a pipeline worker dies: the lines that finished are kept, the others get an error
naming the cause), 2 a problem found before generating (unreadable --prompts, unwritable --out,
bad model or engine options), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), 129 hung up
(SIGHUP): the lines that finished are kept, the others get an "interrupted" error. An "id" is
echoed as given when it is a string or an integer; any other id (NaN, Infinity, 1e999, ...) makes
that line an error naming it, so --out is always valid JSON."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C's KeyboardInterrupt would be: every path that keeps
    finished lines on Ctrl-C (the engine aborts what is in flight) keeps them on these too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def take_signals() -> dict:
    """SIGTERM and SIGHUP (where the platform has them) end the run as Ctrl-C does. Python's
    default for both is to die at once, writing nothing (``--out`` lost). Returns the handlers
    they replace (``main`` puts them back: it is also called in-process, by tests and notebooks).
    Signal handlers can only be set from the main thread: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        raise Interrupted(signum)
    signums = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    return {s: signal.signal(s, handler) for s in signums}


def exit_status(interrupt: KeyboardInterrupt) -> tuple[str, int]:
    """How an interrupted run is reported: its word and exit status (128 + the signal, as a shell
    reports a process a signal ended)."""
    if isinstance(interrupt, Interrupted):
        return f"terminated ({interrupt})", 128 + interrupt.signum
    return "interrupted", 130


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, the dtype it computes in and the threads it computes on (generate, serve and
    bench alike)."""
    from .models import DEFAULT_MODEL, DTYPE_NAMES

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="what the model computes in (default auto: bfloat16 where the device "
                        "computes it natively -- a CPU with AMX-BF16 or AVX512-BF16, a GPU -- "
                        "else float32; float32 gives Hugging Face's fp32 tokens)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one per core); on a machine whose "
                        "cores other jobs use, fewer threads than cores degrade far less")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """One flag per option of any engine (``--block-size`` for ``block_size``, plus the aliases
    and help its config field's metadata gives, ``minillm/runtime/config.py``)."""
    from .engines import all_options

    g = p.add_argument_group("engine options (from the engines' config dataclasses)")
    for name, opt in all_options().items():
        if opt.type is bool:
            g.add_argument(*opt.flags, dest=name, action="store_true", default=None, help=opt.help)
        else:
            g.add_argument(*opt.flags, dest=name, type=opt.type, help=opt.help)


def option_help() -> dict[str, str]:
    """Each engine option's help, as the CLI shows it (from the config fields' metadata)."""
    from .engines import all_options

    return {name: opt.help for name, opt in all_options().items()}


def make_requests(llm, lines: list[Line], adapters: dict | None = None) -> list:
    """A Request per parsed line; a line whose sampling parameters are invalid, or whose "lora"
    names no adapter of ``--lora-modules``, gets its error."""
    from .checks import check_field
    from .request import SamplingParams

    requests = []
    for line in (line for line in lines if not line.error):
        prompt, params, extra = line.spec
        try:
            priority = check_field("priority", extra["priority"])
            req = llm.make_requests([prompt], [SamplingParams(**params)])[0]
            req.lora_request = lora_of(extra["lora"], adapters or {})
        except ValueError as e:
            line.error = f"line {line.lineno}: {e}"
            continue
        req.request_id, req.priority = line.request_id, priority
        requests.append(req)
    return requests


def lora_of(name: str | None, adapters: dict):
    if name is not None and name not in adapters:
        raise ValueError(f"lora {name!r} is not an adapter of --lora-modules "
                         f"({', '.join(adapters) or 'none given'})")
    return adapters.get(name) if name is not None else None


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_generate(args: argparse.Namespace) -> int:
    from .engines import options_from, resolve

    options = options_from(args)
    try:
        spec = resolve(args.engine, options)[0]
    except ValueError as e:
        return fail(str(e))
    if spec.worker is not None and int(os.environ.get("RANK", 0)) > 0:
        # Under torchrun (rung 7): ranks 1..N-1 serve their pipeline stage; rank 0 (below) reads
        # the prompts, schedules and writes --out.
        return spec.load_worker()(args.model, dtype=args.dtype, **options)
    defaults = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                                  ("seed", args.seed)) if v is not None}
    try:
        lines = read_lines(args.prompts, defaults)
    except OSError as e:
        return fail(f"cannot read --prompts {args.prompts}: {e.strerror or e}")
    try:
        write_rows(args.out, [], check_only=True)
    except OSError as e:
        return fail(f"cannot write --out {args.out}: {e.strerror or e}")

    from .llm import LLM
    from .serve.lora import load_adapters, parse_lora_modules
    try:
        llm = LLM(args.model, engine=args.engine, dtype=args.dtype, threads=args.threads,
                  **options)
        adapters = load_adapters(llm, parse_lora_modules(args.lora_modules))
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        return fail(str(e))
    outputs, metrics, failure, interrupt = {}, None, None, None
    # If the run stops early -- Ctrl-C, SIGTERM/SIGHUP, or the engine fails (a pipeline worker
    # dies, a bug) -- the engine has aborted what was in flight: keep the outputs that finished,
    # and give every other line an error saying why, instead of a traceback and no --out at all.
    try:
        requests = make_requests(llm, lines, adapters)
        metrics = llm.run(requests, progress=not args.quiet,
                          on_output=lambda out: outputs.__setitem__(out.request_id, out)).metrics
    except KeyboardInterrupt as e:
        interrupt = e
    except Exception as e:
        failure = " ".join(f"{type(e).__name__}: {e}".split())   # one line, whatever e says
    finally:
        close_engine(llm)
    word = exit_status(interrupt)[0] if interrupt is not None else "interrupted"
    unfinished = f"not finished: the run stopped ({failure})" if failure else \
        f"{word} before it finished"
    rows = [output_row(line, outputs.get(line.request_id), unfinished) for line in lines]
    try:
        write_rows(args.out, rows)
    except OSError as e:
        return fail(f"cannot write --out {args.out}: {e.strerror or e}")
    return report(args.out, rows, sum(not line.error for line in lines) - len(outputs), metrics,
                  failure, interrupt)


def close_engine(llm) -> None:
    """Stop what the engine started (the pipeline's worker processes) now, not at exit."""
    llm.engine.close()


def report(out: str, rows: list[dict], unfinished: int, metrics, failure: str | None,
           interrupt: KeyboardInterrupt | None = None) -> int:
    """The one stderr line of a generate run, and its exit status."""
    ok = sum("error" not in row for row in rows)
    if failure is not None:
        print(f"error: {failure}: {ok}/{len(rows)} ok, {unfinished} unfinished -> {out}",
              file=sys.stderr)
        return 1
    if metrics is None:
        word, status = exit_status(interrupt or KeyboardInterrupt())
        print(f"{word}: {ok}/{len(rows)} ok, {unfinished} unfinished -> {out}", file=sys.stderr)
        return status
    print(f"{ok}/{len(rows)} ok, {metrics.output_tokens} tokens in {metrics.duration_s:.1f}s "
          f"({metrics.output_tok_s:.1f} tok/s) -> {out}", file=sys.stderr)
    return 1 if ok < len(rows) else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.loadgen import main as serve_bench_main, serve_only_flags

    if args.serve:   # against a running server: no model is loaded here
        return serve_bench_main(args)
    if serve_only_flags(args):
        print(f"error: {', '.join(serve_only_flags(args))} only apply with --serve URL",
              file=sys.stderr)
        return 2
    from .bench.offline import main as bench_main

    return bench_main(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from .engines import options_from
    from .serve.cli import main as serve_main

    return serve_main(args, options_from(args))


def build_parser() -> argparse.ArgumentParser:
    from .engines import ENGINES

    p = argparse.ArgumentParser(prog="python -m minillm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate for every line of a JSONL file",
                       description=GENERATE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--engine", default="paged", choices=ENGINES)
    add_model_args(g)
    g.add_argument("--prompts", required=True, help="input JSONL")
    g.add_argument("--out", required=True, help="output JSONL (same order; replaced atomically)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=None,
                   help='LoRA adapters a line may name ("lora": NAME); needs --enable-lora')
    add_engine_options(g)
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="run engines side by side on one workload")
    from .bench.offline import add_bench_args
    add_bench_args(b)
    add_model_args(b)
    from .bench.loadgen import add_serve_bench_args
    add_serve_bench_args(b)
    add_engine_options(b)
    b.set_defaults(func=cmd_bench)
    from .serve.cli import SERVE_HELP, add_serve_args
    s = sub.add_parser("serve", help="an OpenAI-compatible server with a live dashboard",
                       description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(s)
    add_model_args(s)
    add_engine_options(s)
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    """The CLI. From its first line on, Ctrl-C, SIGTERM and SIGHUP end it with one line on stderr
    and 130 / 143 / 129 (while torch loads, the parser is built or --out is written too); during
    generation they keep the finished lines (``cmd_generate``)."""
    previous = take_signals()
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt as e:   # outside generation (imports, loading the model, --out)
        word, status = exit_status(e)
        print(f"error: {word}", file=sys.stderr)
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
