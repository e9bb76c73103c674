"""What int8 weights cost in accuracy (rung 14, notebook 14):
``python -m minillm.bench.quant_accuracy``.

Measured as rung 9 measures KV formats (``kv_accuracy.py``), each ``quantization`` against the
model's own weights: greedy agreement on the bundled chat prompts (the share identical, where
the others first diverge), mean KL of the next-token distributions over ``data/passage.txt``
(teacher-forced, one prefill) and the perplexity there; and the bytes of the linear weights.
"""
from __future__ import annotations

import argparse

import torch

from ..core.runner import ModelRunner, pad_tables
from ..layers.attention import get_attention_backend
from ..layers.attention.reference import AttentionMetadata
from ..layers.config import ModelConfig, QUANTIZATIONS
from ..layers.linear import get_linear_kernel
from .kv_accuracy import PASSAGE, accuracy_text, agreement, greedy_outputs, kl_and_perplexity

BLOCK_SIZE = 16


@torch.inference_mode()
def passage_logprobs(model, ids: list[int], quantization: str | None) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] at every position of ``ids`` (one prefill chunk),
    the linear layers' weights in ``quantization``'s format (None: the model's)."""
    n, dev = len(ids), model.device
    nblocks = -(-n // BLOCK_SIZE)
    name = ModelConfig(quantization=quantization).linear_backend
    runner = ModelRunner(model, nblocks, BLOCK_SIZE,
                         get_attention_backend(None, dev, model.dtype),
                         linear_kernel=get_linear_kernel(name, dev, model.dtype))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev), num_decode=0,
        decode_block_tables=pad_tables([], dev),
        decode_context_lens=torch.empty(0, dtype=torch.int32, device=dev),
        prefill_block_tables=pad_tables([list(range(nblocks))], dev),
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        prefill_q_lens=[n], prefill_ctx_lens=[n])
    hidden = runner.forward(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta)
    return runner.net.logits(runner.net.final_hidden(hidden)).log_softmax(-1)


def weight_bytes(model, quantization: str | None) -> int:
    """Bytes of every linear weight (lm_head included) as stored: int8 + one fp32 scale per row,
    or the model's dtype."""
    total = 0
    for m in model.hf_model.modules():
        if isinstance(m, torch.nn.Linear):
            rows, cols = m.weight.shape
            total += rows * cols + 4 * rows if quantization else m.weight.nbytes
    return total


def measure(model, quantizations=("int8",), num_prompts: int = 32, max_tokens: int = 64,
            progress=print) -> list[dict]:
    """One row per format, the model's own weights first (the reference of the others)."""
    from ..workload import load_prompts

    prompts = [{"messages": p["messages"]} for p in load_prompts()[:num_prompts]]
    ids = model.tokenizer.encode(PASSAGE.read_text(encoding="utf-8"))
    rows, ref_lp, ref_out = [], None, None
    for q in (None, *quantizations):
        lp = passage_logprobs(model, ids, q)
        out = greedy_outputs(model, prompts, "auto", max_tokens, quantization=q)
        ref_lp, ref_out = (lp, out) if ref_lp is None else (ref_lp, ref_out)
        kl, ppl = kl_and_perplexity(ref_lp, lp, ids)
        tokens = sum(len(o) for o in out)
        same = sum(a == b for r, g in zip(ref_out, out) for a, b in zip(r, g))
        rows.append({"weights": q or str(model.dtype).replace("torch.", ""),
                     "weight_bytes": weight_bytes(model, q), "kl_mean": kl, "perplexity": ppl,
                     "passage_tokens": len(ids), "prompts": len(prompts),
                     "max_tokens": max_tokens, "tokens_agree_before_divergence": same / tokens,
                     **agreement(ref_out, out)})
        if progress:
            progress(format_row(rows[-1]))
    return rows


def format_row(r: dict) -> str:
    return f"{r['weights']:8s} {r['weight_bytes'] / 1e6:7.1f} MB  {accuracy_text(r)}"


def main(argv: list[str] | None = None) -> int:
    from ..models import DEFAULT_MODEL, load_model
    p = argparse.ArgumentParser(prog="python -m minillm.bench.quant_accuracy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="int8",
                   help=f"comma-separated, of {', '.join(QUANTIZATIONS)}")
    p.add_argument("--prompts", type=int, default=32, help="bundled chat prompts (greedy)")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    qs = tuple(args.quantization.split(","))
    for q in qs:
        ModelConfig(quantization=q)          # an unknown name: its error, before any work
    model = load_model(args.model, dtype=args.dtype)
    print(f"{args.model} ({model.dtype}): {args.prompts} chat prompts x {args.max_tokens} "
          f"greedy tokens, passage {PASSAGE.name}; reference: the model's own weights")
    measure(model, qs, args.prompts, args.max_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
