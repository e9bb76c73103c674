"""What structured output costs per step: ``python -m minillm.bench.structured_mask [--rows 64]``.

Times ``structured.apply_grammar_masks`` (fill each constrained row's token bitmask with its
xgrammar matcher, then set the forbidden logits to -inf in place) on a batch of ``--rows`` rows,
each following a JSON schema, for ``--steps`` steps, against the model's vocabulary (SmolLM2's
49,152 tokens by default). Each row then commits its argmax of random logits (a random walk
through the grammar: strings, numbers, arrays, nesting), and a row whose grammar completes starts
over, so every step masks every row. Beside it: xgrammar's ``BatchGrammarMatcher`` filling the
same bitmask on its threads, and the batch's plain argmax, for scale. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..models import load_model
from ..structured import StructuredOutputsParams, apply_grammar_masks, compiler_for

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "integer"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"]}


WARM = 5          # steps left out of the times: the first fills of each matcher's caches


def walk(rows: int, steps: int, model, batched: bool) -> list[float]:
    """Milliseconds of the mask per step over a random walk of ``rows`` matchers."""
    import xgrammar as xgr
    compiled = compiler_for(model.tokenizer, model.config.vocab_size,
                            model.eos_token_ids).compile(StructuredOutputsParams(json=SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    batch = xgr.BatchGrammarMatcher() if batched else None
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(rows, model.config.vocab_size, generator=gen).to(model.device)
        _sync(model.device)
        t = time.perf_counter()
        if batch is None:
            apply_grammar_masks(logits, matchers)
        else:
            bitmask = xgr.allocate_token_bitmask(rows, logits.shape[-1])
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        _sync(model.device)
        times.append((time.perf_counter() - t) * 1e3)
        for m, token in zip(matchers, logits.argmax(dim=-1).tolist()):
            if not m.accept_token(token) or m.is_terminated():
                m.reset()
    return times


def _sync(device: torch.device) -> None:
    """On a GPU the mask's copy and kernel are asynchronous: wait for them before reading the
    clock, so a step's time includes them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    if args.steps < WARM + 1 or args.rows < 1:
        ap.error(f"--steps must be > {WARM} (the first {WARM} warm up; got {args.steps}) and "
                 f"--rows >= 1 (got {args.rows})")
    model = load_model(args.model, dtype=torch.float32)
    logits = torch.randn(args.rows, model.config.vocab_size, device=model.device)
    t = time.perf_counter()
    for _ in range(20):
        logits.argmax(dim=-1)
    _sync(model.device)
    out = {"model": args.model, "vocab": model.config.vocab_size, "rows": args.rows,
           "steps": args.steps, "threads": torch.get_num_threads(), "device": str(model.device),
           "argmax_ms": round((time.perf_counter() - t) / 20 * 1e3, 3)}
    for name, batched in (("mask", False), ("batch_matcher", True)):
        times = walk(args.rows, args.steps, model, batched)[WARM:]
        out[f"{name}_ms_median"] = round(statistics.median(times), 3)
        out[f"{name}_ms_p90"] = round(sorted(times)[int(0.9 * len(times))], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
