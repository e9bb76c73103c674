"""What computing in bf16 costs, measured: ``python -m minillm.bench.dtype_accuracy`` (``make profile``).

Rung 9 measures a narrower KV cache against the model's own; this measures a narrower *model*
(``--dtype bfloat16``: weights, activations and KV in bf16; norms, softmax and logits in fp32)
against fp32, with the same three measures (``kv_accuracy.py``):

* **greedy agreement** on the bundled chat prompts: the share of identical outputs, and where the
  others first diverge;
* **KL divergence** of the next-token distributions over ``data/passage.txt`` (teacher-forced,
  one prefill through the paged runner), mean over positions;
* **perplexity** on the same text.
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

from .kv_accuracy import (PASSAGE, accuracy_text, agreement, greedy_outputs, kl_and_perplexity,
                          passage_logprobs)


def measure(name: str, dtypes=("bfloat16",), num_prompts: int = 32, max_tokens: int = 64,
            progress=print) -> list[dict]:
    """One row per dtype, fp32 first (the reference every other row is compared with)."""
    from ..models import load_model
    from ..workload import load_prompts

    prompts = [{"messages": p["messages"]} for p in load_prompts()[:num_prompts]]
    rows, ref_lp, ref_out = [], None, None
    for dtype in ["float32"] + [d for d in dtypes if d != "float32"]:
        model = load_model(name, dtype=dtype)
        ids = model.tokenizer.encode(PASSAGE.read_text(encoding="utf-8"))
        lp = passage_logprobs(model, ids, "auto")
        out = greedy_outputs(model, prompts, "auto", max_tokens)
        ref_lp, ref_out = (lp, out) if ref_lp is None else (ref_lp, ref_out)
        kl, ppl = kl_and_perplexity(ref_lp, lp, ids)
        rows.append({"dtype": dtype, "kl_mean": kl, "perplexity": ppl, "passage_tokens": len(ids),
                     "prompts": len(prompts), "max_tokens": max_tokens,
                     **agreement(ref_out, out)})
        if progress:
            progress(format_row(rows[-1]))
        del model, lp
        gc.collect()
    return rows


def format_row(r: dict) -> str:
    return f"{r['dtype']:9s} {accuracy_text(r)}"


def main(argv: list[str] | None = None) -> int:
    from ..models import DEFAULT_MODEL, DTYPES

    p = argparse.ArgumentParser(prog="python -m minillm.bench.dtype_accuracy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtypes", default="bfloat16", help="compared with float32, comma-separated")
    p.add_argument("--prompts", type=int, default=32, help="bundled chat prompts (greedy)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if bad := [d for d in dtypes if d not in DTYPES]:
        p.error(f"unknown dtype(s) {', '.join(bad)}: choose from {', '.join(DTYPES)}")
    print(f"{args.model}: {args.prompts} chat prompts x {args.max_tokens} greedy tokens, passage "
          f"{PASSAGE.name}; reference: float32")
    rows = measure(args.model, dtypes, args.prompts, args.max_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"rows -> {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
