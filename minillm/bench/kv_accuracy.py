"""What a narrower KV cache costs, measured (rung 9, notebook 09): ``python -m minillm.bench.kv_accuracy``.

For each ``kv_cache_dtype`` against the model's own (fp32 on the CPU):

* **greedy agreement** on the bundled chat prompts: the share of requests whose greedy output is
  identical, and where the others first diverge (a flipped token changes everything after it, so
  the first divergence is the honest measure);
* **KL divergence** of the next-token distributions over a fixed text (``data/passage.txt``,
  teacher-forced: every position reads its context from the narrow cache), mean over positions;
* **perplexity** on the same text.

The passage is run as one prefill chunk through the paged model runner and its real KV pool; a
narrow pool is read through it for every position, the chunk's own tokens included
(``TorchAttention.extend``), so position t sees exactly the K/V a decode at t would see.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..layers.attention import get_attention_backend
from ..layers.attention.reference import AttentionMetadata
from ..layers.kv_quant import KV_CACHE_DTYPES, get_format
from ..core.runner import ModelRunner, pad_tables

PASSAGE = Path(__file__).resolve().parents[1] / "data" / "passage.txt"
BLOCK_SIZE = 16


@torch.inference_mode()
def prefill(model, ids: list[int], kv_cache_dtype: str = "auto", backend=None
            ) -> tuple[ModelRunner, torch.Tensor]:
    """``ids`` through a fresh model runner as one prefill chunk, token i's K/V in slot i (blocks
    0, 1, ... in order). Returns the runner (its pool holds the K/V) and the final hidden states."""
    n = len(ids)
    nblocks = -(-n // BLOCK_SIZE)
    backend = backend or get_attention_backend(None, model.device, model.dtype)
    runner = ModelRunner(model, nblocks, BLOCK_SIZE, backend,
                         kv_format=get_format(kv_cache_dtype))
    dev = model.device
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev), num_decode=0,
        decode_block_tables=pad_tables([], dev),
        decode_context_lens=torch.empty(0, dtype=torch.int32, device=dev),
        prefill_block_tables=pad_tables([list(range(nblocks))], dev),
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        prefill_q_lens=[n], prefill_ctx_lens=[n])
    hidden = runner.forward(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta)
    return runner, runner.net.final_hidden(hidden)


@torch.inference_mode()
def passage_logprobs(model, ids: list[int], kv_cache_dtype: str, backend=None) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] of the next token at every position of ``ids``, its
    KV stored as ``kv_cache_dtype`` says."""
    runner, hidden = prefill(model, ids, kv_cache_dtype, backend)
    return runner.net.logits(hidden).log_softmax(-1)


def kl_and_perplexity(ref: torch.Tensor, got: torch.Tensor, ids: list[int]) -> tuple[float, float]:
    """Mean KL(ref || got) over positions, and the perplexity of ``got`` on ``ids``."""
    kl = (ref.exp() * (ref - got)).sum(-1).mean()
    nll = -got[:-1].gather(1, torch.tensor(ids[1:], device=got.device)[:, None]).mean()
    return float(kl), float(nll.exp())


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter's end), None if identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_outputs(model, prompts: list[dict], kv_cache_dtype: str, max_tokens: int,
                   **options) -> list[list[int]]:
    from .. import LLM, SamplingParams
    # the engine and its pool (1 GiB by default) go when this returns: an engine keeps no
    # reference cycle (tests/runtime/test_observe.py). With one, each format's pool would wait for
    # the garbage collector, and notebook 09's kernel would reach 9 GB.
    llm = LLM(model, engine="paged", kv_cache_dtype=kv_cache_dtype, **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0),
                        progress=False)
    return [o.token_ids for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    firsts = [first_divergence(r, g) for r, g in zip(ref, got)]
    diverged = [f for f in firsts if f is not None]
    return {"identical_share": 1 - len(diverged) / len(ref),
            "first_divergence_mean": sum(diverged) / len(diverged) if diverged else None,
            "first_divergence_min": min(diverged) if diverged else None}


def measure(model, dtypes=KV_CACHE_DTYPES, num_prompts: int = 32, max_tokens: int = 64,
            progress=print, passage_tokens: int | None = None, **options) -> list[dict]:
    """One row per dtype (``auto`` first: the reference every other row is compared with);
    ``passage_tokens``: KL and perplexity over the passage's first tokens only (all by default;
    notebook 09's quick run takes 64)."""
    from ..workload import load_prompts

    if passage_tokens is not None and (isinstance(passage_tokens, bool)
                                       or not isinstance(passage_tokens, int) or passage_tokens < 2):
        raise ValueError(f"passage_tokens must be an int >= 2 (a next token to predict), "
                         f"got {passage_tokens!r}")
    dtypes = ["auto"] + [d for d in dtypes if d != "auto"]
    prompts = [{"messages": p["messages"]} for p in load_prompts()[:num_prompts]]
    ids = model.tokenizer.encode(PASSAGE.read_text(encoding="utf-8"))[:passage_tokens]
    rows, ref_lp, ref_out = [], None, None
    for name in dtypes:
        lp = passage_logprobs(model, ids, name)
        out = greedy_outputs(model, prompts, name, max_tokens, **options)
        ref_lp, ref_out = (lp, out) if ref_lp is None else (ref_lp, ref_out)
        kl, ppl = kl_and_perplexity(ref_lp, lp, ids)
        fmt = get_format(name)
        rows.append({"kv_cache_dtype": name,
                     "bytes_per_token": fmt.bytes_per_token(*model.kv_geometry, model.dtype),
                     "kl_mean": kl, "perplexity": ppl, "passage_tokens": len(ids),
                     "prompts": len(prompts), "max_tokens": max_tokens,
                     **agreement(ref_out, out)})
        if progress:
            progress(format_row(rows[-1]))
    return rows


def accuracy_text(r: dict) -> str:
    """The accuracy columns every format's row prints (KV formats here, dtypes and weight
    formats in dtype_accuracy.py and quant_accuracy.py)."""
    first = r["first_divergence_mean"]
    return (f"identical {100 * r['identical_share']:5.1f}%  first divergence "
            f"{'-' if first is None else f'{first:.1f}':>5s}  KL {r['kl_mean']:.2e}  "
            f"perplexity {r['perplexity']:.3f}")


def format_row(r: dict) -> str:
    return f"{r['kv_cache_dtype']:9s} {r['bytes_per_token']:6d} B/token  {accuracy_text(r)}"


def main(argv: list[str] | None = None) -> int:
    from ..models import DEFAULT_MODEL, load_model
    p = argparse.ArgumentParser(prog="python -m minillm.bench.kv_accuracy", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtypes", default=",".join(KV_CACHE_DTYPES))
    p.add_argument("--prompts", type=int, default=32, help="bundled chat prompts (greedy)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--passage-tokens", type=int, default=None,
                   help="KL and perplexity over the passage's first N tokens (default: all)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    for d in args.dtypes.split(","):
        get_format(d)                       # an unknown name: its error, before any work
    if args.passage_tokens is not None and args.passage_tokens < 2:
        p.error(f"--passage-tokens must be >= 2 (a next token to predict), got {args.passage_tokens}")
    model = load_model(args.model)
    print(f"{args.model}: {args.prompts} chat prompts x {args.max_tokens} greedy tokens, "
          f"passage {PASSAGE.name}; reference: the model's dtype ({model.dtype})")
    rows = measure(model, args.dtypes.split(","), args.prompts, args.max_tokens,
                   passage_tokens=args.passage_tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"rows -> {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
