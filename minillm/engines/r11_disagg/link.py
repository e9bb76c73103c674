"""What link disaggregation needs (notebook 11, docs/rungs/11_disagg.md): the KV bytes of a prompt, and the
bandwidth that keeps up with a prefill worker at GPU speed.

A prefill worker that computes ``r`` prompt tokens per second hands ``r × kv_bytes_per_token``
bytes per second to the decode side; the link must carry that, or the decode side waits for
blocks. The model shapes below are the public configs; the GPU prefill rate is the FLOPs
arithmetic (2 × parameters per token, at a stated share of a stated peak) and the links are
rung 10's nominal ones (``r10_tensor.traffic.NOMINAL_LINKS``): inputs to the arithmetic, not
measurements. This machine's own numbers come from ``measure.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..r10_tensor.traffic import NOMINAL_LINKS, Link

H100_BF16_FLOPS = 989e12        # dense bf16 peak of an H100 SXM (its datasheet)
MFU = 0.5                       # the share of it a long prefill reaches (an assumption)


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float               # parameters
    layers: int
    kv_heads: int
    head_dim: int
    elem_bytes: int = 2         # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.elem_bytes

    def prefill_tok_s(self, peak_flops: float = H100_BF16_FLOPS, mfu: float = MFU) -> float:
        """Prompt tokens per second on one GPU: compute-bound, 2 FLOPs per parameter per token
        (attention's own FLOPs left out: they only lower the rate, and with it the need)."""
        return peak_flops * mfu / (2 * self.params)


SHAPES = (ModelShape("SmolLM2-135M (fp32, as here)", 0.135e9, 30, 3, 64, 4),
          ModelShape("Llama-3-8B", 8.0e9, 32, 8, 128),
          ModelShape("Llama-2-7B (no GQA)", 6.7e9, 32, 32, 128),
          ModelShape("Llama-3-70B", 70.6e9, 80, 8, 128))


def needed_bytes_s(shape: ModelShape) -> float:
    """Bytes per second the link must carry to keep up with one GPU's prefill."""
    return shape.prefill_tok_s() * shape.kv_bytes_per_token


def handoff_seconds(shape: ModelShape, prompt_tokens: int, link: Link) -> float:
    """One prompt's KV over ``link`` (one message per layer's K and V)."""
    return link.seconds(prompt_tokens * shape.kv_bytes_per_token, messages=2 * shape.layers)


def link_table(prompt_tokens: int = 2048, links: tuple[Link, ...] = NOMINAL_LINKS) -> str:
    """Markdown: per model, the KV of one prompt, the bandwidth to keep up with an H100's
    prefill, and the prompt's hand-off time on each link next to its prefill time."""
    head = ["model", "KV bytes / token", f"KV of a {prompt_tokens}-token prompt",
            "H100 prefill (tok/s, nominal)", "link to keep up (GB/s)",
            "prefill of the prompt (ms)"] + [f"hand-off on {k.name} (ms)" for k in links]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in SHAPES:
        rate = s.prefill_tok_s()
        cells = [s.name, f"{s.kv_bytes_per_token:,}",
                 f"{prompt_tokens * s.kv_bytes_per_token / 2**20:,.0f} MiB", f"{rate:,.0f}",
                 f"{needed_bytes_s(s) / 1e9:.1f}", f"{prompt_tokens / rate * 1e3:.0f}"]
        cells += [f"{handoff_seconds(s, prompt_tokens, k) * 1e3:.1f}" for k in links]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
