"""Command line: ``python -m minillm generate ...``, ``python -m minillm bench ...`` and
``python -m minillm serve ...`` (an OpenAI-compatible server, ``minillm/serve/``)."""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import tempfile
from dataclasses import dataclass

from .engines import ENGINES, all_options, options_from, resolve

GENERATE_HELP = """\
Generate for every non-blank line of a UTF-8 JSONL file (a leading BOM is ignored): an object with
one of "prompt", "messages", "prompt_token_ids", and optionally "id", "max_tokens", "temperature",
"top_p", "top_k", "seed", "n", "beam_width", "priority", "ignore_eos". --out gets one line per
input line, in order: a result, or {"id", "error"}; it is replaced atomically, never left
half-written. Exit status: 0 all ok, 1 some lines failed (also when the engine itself fails
mid-run, e.g. a pipeline worker dies: the lines that finished are kept, the others get an error
naming the cause), 2 a problem found before generating (unreadable --prompts, unwritable --out,
bad model or engine options), 130 interrupted (Ctrl-C): the lines that finished are kept, the
others get an "interrupted" error."""

# JSONL fields a generate line may carry, and their types
LINE_FIELDS = {"id": (str, int), "messages": list, "prompt": str, "prompt_token_ids": list,
               "max_tokens": int, "temperature": (int, float), "top_p": (int, float),
               "top_k": int, "seed": int, "n": int, "beam_width": int, "priority": int,
               "ignore_eos": bool}
PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "beam_width",
                "ignore_eos")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """One flag per option of any engine (``--block-size`` for ``block_size``, plus the aliases
    and help its config field's metadata gives, ``minillm/core/config.py``)."""
    g = p.add_argument_group("engine options (from the engines' config dataclasses)")
    for name, opt in all_options().items():
        if opt.type is bool:
            g.add_argument(*opt.flags, dest=name, action="store_true", default=None, help=opt.help)
        else:
            g.add_argument(*opt.flags, dest=name, type=opt.type, help=opt.help)


# Each engine option's help, as the CLI shows it (generated from the config fields' metadata)
OPTION_HELP = {name: opt.help for name, opt in all_options().items()}


@dataclass
class Line:
    """One non-blank input line: its id, and either an error or what to generate."""

    lineno: int
    id: object
    error: str | None = None
    spec: tuple | None = None   # (prompt, SamplingParams kwargs, extras)

    @property
    def request_id(self) -> str:
        return f"line-{self.lineno}"


def load_json(lineno: int, raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        why = f"not valid UTF-8 (byte 0x{e.object[e.start]:02x} at column {e.start + 1})"
    except json.JSONDecodeError as e:
        why = f"invalid JSON ({e.msg})"
    except RecursionError:
        why = "invalid JSON (nested too deeply)"
    except ValueError as e:   # e.g. an integer literal too long to convert
        why = f"invalid JSON ({e})"
    raise ValueError(f"line {lineno}: {why}")


def parse_line(lineno: int, obj, defaults: dict) -> tuple[object, dict, dict]:
    """A decoded JSONL line -> (prompt, SamplingParams kwargs, extras); ValueError says why not."""
    if not isinstance(obj, dict):
        raise ValueError(f"line {lineno}: expected a JSON object")
    unknown = sorted(set(obj) - set(LINE_FIELDS))
    if unknown:
        raise ValueError(f"line {lineno}: unknown field(s) {', '.join(unknown)}")
    for key, value in obj.items():
        typ = LINE_FIELDS[key]
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
            raise ValueError(f"line {lineno}: field {key!r} has the wrong type "
                             f"({type(value).__name__})")
    sources = [k for k in ("messages", "prompt", "prompt_token_ids") if k in obj]
    if len(sources) != 1:
        raise ValueError(f"line {lineno}: needs exactly one of messages, prompt, prompt_token_ids")
    params = {**defaults, **{k: obj[k] for k in PARAM_FIELDS if k in obj}}
    return {sources[0]: obj[sources[0]]}, params, {"priority": obj.get("priority", 0)}


def read_lines(path: str, defaults: dict) -> list[Line]:
    """Parse each non-blank line of the JSONL file ``path`` (OSError if it cannot be read); a bad
    line (not UTF-8, not JSON, wrong fields) gets its error. A leading UTF-8 BOM is dropped."""
    with open(path, "rb") as f:
        data = f.read().removeprefix(b"\xef\xbb\xbf")
    lines = []
    for lineno, raw in enumerate(data.splitlines(), 1):
        if not raw.decode("utf-8", "replace").strip():
            continue
        line = Line(lineno, lineno)
        try:
            obj = load_json(lineno, raw)
            line.id = obj.get("id", lineno) if isinstance(obj, dict) else lineno
            line.spec = parse_line(lineno, obj, defaults)
        except ValueError as e:
            line.error = str(e)
        lines.append(line)
    return lines


def make_requests(llm, lines: list[Line]) -> list:
    """A Request per parsed line; a line whose sampling parameters are invalid gets its error."""
    from .request import SamplingParams

    requests = []
    for line in (line for line in lines if not line.error):
        prompt, params, extra = line.spec
        try:
            req = llm.make_requests([prompt], [SamplingParams(**params)])[0]
        except ValueError as e:
            line.error = f"line {line.lineno}: {e}"
            continue
        req.request_id, req.priority = line.request_id, extra["priority"]
        requests.append(req)
    return requests


def output_row(line: Line, out, unfinished: str = "interrupted before it finished") -> dict:
    """``line``'s output row: its result, or its error; ``out`` is None for a line whose request
    never finished, which gets the error ``unfinished`` (why the run stopped)."""
    if line.error:
        return {"id": line.id, "error": line.error}
    if out is None:
        return {"id": line.id, "error": f"line {line.lineno}: {unfinished}"}
    if out.error:   # engine errors start with the request id, "line-N: "
        return {"id": line.id, "error": f"line {line.lineno}: "
                                        f"{out.error.removeprefix(line.request_id + ': ')}"}
    row = {"id": line.id, "text": out.text, "token_ids": out.token_ids,
           "finish_reason": out.finish_reason.value, "ttft_s": out.ttft_s,
           "latency_s": out.latency_s}
    if len(out.samples) > 1:
        row["samples"] = out.samples
    return row


def write_rows(path: str, rows, check_only: bool = False) -> None:
    """Write JSONL rows atomically: a temp file beside ``path`` (a symlink's target), renamed onto
    it once complete; a device or pipe (``/dev/null``) is written in place. ``check_only``: just
    create and remove that temp file, so an OSError says now, before any work, that we can't."""
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Is a directory")
    if os.path.exists(path) and not os.path.isfile(path):
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, "Permission denied")
        if not check_only:   # (opening a pipe would wait for its reader)
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        return
    path = os.path.realpath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
            f.flush()
            os.fsync(f.fileno())
        if not check_only:
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)   # mkstemp made it 0600: give it a new file's mode
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_generate(args: argparse.Namespace) -> int:
    options = options_from(args)
    try:
        spec = resolve(args.engine, options)[0]
    except ValueError as e:
        return fail(str(e))
    if spec.worker is not None and int(os.environ.get("RANK", 0)) > 0:
        # Under torchrun (rung 7): ranks 1..N-1 serve their pipeline stage; rank 0 (below) reads
        # the prompts, schedules and writes --out.
        return spec.load_worker()(args.model, **options)
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
    try:
        llm = LLM(args.model, engine=args.engine, **options)
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        return fail(str(e))
    requests, outputs, metrics, failure = make_requests(llm, lines), {}, None, None
    # If the run stops early -- Ctrl-C, or the engine fails (a pipeline worker dies, a bug) --
    # the engine has aborted what was in flight: keep the outputs that finished, and give every
    # other line an error saying why, instead of a traceback and no --out at all.
    try:
        metrics = llm.run(requests, progress=not args.quiet,
                          on_output=lambda out: outputs.__setitem__(out.request_id, out)).metrics
    except KeyboardInterrupt:
        pass
    except Exception as e:
        failure = " ".join(f"{type(e).__name__}: {e}".split())   # one line, whatever e says
    finally:
        close_engine(llm)
    unfinished = f"not finished: the run stopped ({failure})" if failure else \
        "interrupted before it finished"
    rows = [output_row(line, outputs.get(line.request_id), unfinished) for line in lines]
    try:
        write_rows(args.out, rows)
    except OSError as e:
        return fail(f"cannot write --out {args.out}: {e.strerror or e}")
    return report(args.out, rows, len(requests) - len(outputs), metrics, failure)


def close_engine(llm) -> None:
    """Stop what the engine started (the pipeline's worker processes) now, not at exit."""
    close = getattr(llm.engine, "close", None)
    if close is not None:
        close()


def report(out: str, rows: list[dict], unfinished: int, metrics, failure: str | None) -> int:
    """The one stderr line of a generate run, and its exit status."""
    ok = sum("error" not in row for row in rows)
    if failure is not None:
        print(f"error: {failure}: {ok}/{len(rows)} ok, {unfinished} unfinished -> {out}",
              file=sys.stderr)
        return 1
    if metrics is None:
        print(f"interrupted: {ok}/{len(rows)} ok, {unfinished} unfinished -> {out}",
              file=sys.stderr)
        return 130
    print(f"{ok}/{len(rows)} ok, {metrics.output_tokens} tokens in {metrics.duration_s:.1f}s "
          f"({metrics.output_tok_s:.1f} tok/s) -> {out}", file=sys.stderr)
    return 1 if ok < len(rows) else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .serve.loadgen import main as serve_bench_main, serve_only_flags

    if args.serve:   # against a running server: no model is loaded here
        return serve_bench_main(args)
    if serve_only_flags(args):
        print(f"error: {', '.join(serve_only_flags(args))} only apply with --serve URL",
              file=sys.stderr)
        return 2
    from .bench import main as bench_main

    return bench_main(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve.cli import main as serve_main

    return serve_main(args, options_from(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate for every line of a JSONL file",
                       description=GENERATE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--engine", default="paged", choices=ENGINES)
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--prompts", required=True, help="input JSONL")
    g.add_argument("--out", required=True, help="output JSONL (same order; replaced atomically)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_options(g)
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="run engines side by side on one workload")
    from .bench import add_bench_args
    add_bench_args(b)
    from .serve.loadgen import add_serve_bench_args
    add_serve_bench_args(b)
    add_engine_options(b)
    b.set_defaults(func=cmd_bench)
    from .serve.cli import SERVE_HELP, add_serve_args
    s = sub.add_parser("serve", help="an OpenAI-compatible server with a live dashboard",
                       description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(s)
    add_engine_options(s)
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:   # Ctrl-C outside generation (loading the model, writing --out)
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
