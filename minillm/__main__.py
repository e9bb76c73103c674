"""Command line: ``python -m minillm generate ...`` and ``python -m minillm bench ...``."""
from __future__ import annotations

import argparse
import json
import sys

from .engines import ENGINES

# JSONL fields a generate line may carry, and their types
LINE_FIELDS = {"id": (str, int), "messages": list, "prompt": str, "prompt_token_ids": list,
               "max_tokens": int, "temperature": (int, float), "top_p": (int, float),
               "top_k": int, "seed": int, "n": int, "beam_width": int, "priority": int,
               "ignore_eos": bool}
PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "beam_width",
                "ignore_eos")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options (step 1-3)")
    g.add_argument("--batch-size", type=int, help="static: requests per batch")
    g.add_argument("--max-num-seqs", type=int, help="dynamic/paged: max concurrent requests")
    g.add_argument("--block-size", type=int, help="paged: tokens per KV block")
    g.add_argument("--num-blocks", type=int, help="paged: KV pool size in blocks")
    g.add_argument("--kv-cache-bytes", type=int, help="paged: KV pool size in bytes")
    g.add_argument("--max-num-batched-tokens", type=int, help="paged: token budget per step")
    g.add_argument("--enable-prefix-caching", action="store_true", default=None,
                   help="paged: reuse KV blocks of shared prompt prefixes")
    g.add_argument("--policy", choices=("fcfs", "priority"), help="paged: scheduling order")
    g.add_argument("--attention", dest="attention_backend", choices=("torch", "triton"),
                   help="paged: attention backend (default: triton on CUDA, torch on CPU)")


def engine_options(args: argparse.Namespace) -> dict:
    keys = ("batch_size", "max_num_seqs", "block_size", "num_blocks", "kv_cache_bytes",
            "max_num_batched_tokens", "enable_prefix_caching", "policy", "attention_backend")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def parse_line(lineno: int, line: str, defaults: dict) -> tuple[object, dict, dict]:
    """One JSONL line -> (prompt, SamplingParams kwargs, extras); ValueError names the problem."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {lineno}: invalid JSON ({e.msg})") from None
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


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .request import Request, SamplingParams

    try:
        llm = LLM(args.model, engine=args.engine, **engine_options(args))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    defaults = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                                  ("seed", args.seed)) if v is not None}
    with open(args.prompts, encoding="utf-8") as f:
        lines = [(i, ln) for i, ln in enumerate(f, 1) if ln.strip()]
    ids, requests, errors = [], [], {}
    for lineno, line in lines:
        try:
            obj_id = json.loads(line).get("id", lineno) if line.lstrip().startswith("{") else lineno
        except json.JSONDecodeError:
            obj_id = lineno
        ids.append(obj_id)
        try:
            prompt, params, extra = parse_line(lineno, line, defaults)
            req = llm.make_requests([prompt], [SamplingParams(**params)])[0]
        except ValueError as e:
            msg = str(e) if str(e).startswith("line ") else f"line {lineno}: {e}"
            errors[len(ids) - 1] = msg
            continue
        req.request_id, req.priority = f"line-{lineno}", extra["priority"]
        requests.append((len(ids) - 1, req))
    result = llm.run([r for _, r in requests], progress=not args.quiet)
    outputs = dict(zip((i for i, _ in requests), result.outputs))
    failed = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for i, obj_id in enumerate(ids):
            out = outputs.get(i)
            if out is None or out.error:
                failed += 1
                lineno = lines[i][0]   # engine errors start with the request id, "line-N: "
                err = errors.get(i) or f"line {lineno}: {out.error.removeprefix(f'line-{lineno}: ')}"
                f.write(json.dumps({"id": obj_id, "error": err}) + "\n")
                continue
            row = {"id": obj_id, "text": out.text, "token_ids": out.token_ids,
                   "finish_reason": out.finish_reason.value, "ttft_s": out.ttft_s,
                   "latency_s": out.latency_s}
            if len(out.samples) > 1:
                row["samples"] = out.samples
            f.write(json.dumps(row) + "\n")
    m = result.metrics
    print(f"{len(ids) - failed}/{len(ids)} ok, {m.output_tokens} tokens in {m.duration_s:.1f}s "
          f"({m.output_tok_s:.1f} tok/s) -> {args.out}", file=sys.stderr)
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate for every line of a JSONL file")
    g.add_argument("--engine", default="paged", choices=ENGINES)
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--prompts", required=True, help="input JSONL")
    g.add_argument("--out", required=True, help="output JSONL (same order)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--quiet", action="store_true")
    add_engine_options(g)
    g.set_defaults(func=cmd_generate)
    b = sub.add_parser("bench", help="run engines side by side on one workload")
    from .bench import add_bench_args
    add_bench_args(b)
    add_engine_options(b)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
