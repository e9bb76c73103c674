"""Notebook 09's pictures and measurements: what a KV slot holds in each format, why keys are
quantized differently from values (KIVI), the same budget under each format, the accuracy price.

Everything is measured on the real engine: K/V rows come out of a real pool after a real prefill
(``pool_rows``), budgets and concurrency from engine runs, accuracy from ``minillm.bench.kv_accuracy``.
"""
from __future__ import annotations

import torch
from matplotlib.figure import Figure

from ..layers.kv_quant import FORMATS, KV_CACHE_DTYPES, dequantize, quantize

COLORS = {"auto": "#4c72b0", "float16": "#64b5cd", "bfloat16": "#8172b2", "int8": "#55a868",
          "fp8": "#c44e52"}


def slot_bytes_figure(model) -> Figure:
    """One token's K and V over all layers, per format: the stored numbers and their scales."""
    layers, kv_heads, head_dim = model.kv_geometry
    rows = 2 * layers * kv_heads
    fig = Figure(figsize=(9, 2.8))
    ax = fig.add_subplot()
    for i, name in enumerate(KV_CACHE_DTYPES):
        fmt = FORMATS[name]
        total = fmt.bytes_per_token(layers, kv_heads, head_dim, model.dtype)
        scale = rows * 4 if fmt.scaled else 0          # one fp32 scale per stored row
        ax.barh(i, total - scale, color=COLORS[name])
        ax.barh(i, scale, left=total - scale, color="#dd8452", hatch="//")
        ax.text(total, i, f"  {total:,} B/token: {model.kv_bytes_per_token / total:.2f}x the "
                          "tokens of fp32", va="center", fontsize=9)
    ax.set_yticks(range(len(KV_CACHE_DTYPES)), KV_CACHE_DTYPES)
    ax.invert_yaxis()
    ax.set_xlim(0, model.kv_bytes_per_token * 1.6)
    ax.set_xlabel(f"bytes per token ({layers} layers x K and V x {kv_heads} heads x {head_dim}); "
                  "hatched: the fp32 scales")
    fig.tight_layout()
    return fig


def pool_rows(pool, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``num_tokens`` slots' K and V rows [T, kv_heads, head_dim] of one layer of a
    full-precision pool (``kv_accuracy.prefill`` puts token i in slot i)."""
    k, v = pool.caches[layer]
    return (k.view(-1, *k.shape[2:])[:num_tokens].clone(),
            v.view(-1, *v.shape[2:])[:num_tokens].clone())


def quant_error(x: torch.Tensor, per: str) -> float:
    """Relative error (Frobenius) of int8 quantization of rows ``x`` [T, heads, D], with one scale
    per token and head (``per="token"``: what the engine does) or one per channel and head over
    the tokens (``per="channel"``: KIVI's choice for keys)."""
    if per == "channel":
        xt = x.permute(1, 2, 0)                                 # [heads, D, T]: scale over tokens
        back = dequantize(*quantize(xt, FORMATS["int8"]), torch.float32).permute(2, 0, 1)
    else:
        back = dequantize(*quantize(x, FORMATS["int8"]), torch.float32)
    return float((back - x).norm() / x.norm())


def channel_figure(k: torch.Tensor, v: torch.Tensor, layer: int) -> Figure:
    """Largest |value| of each of head 0's channels over the tokens: keys have a few outlier
    channels (they set every token's int8 scale and squeeze the others), values do not."""
    fig = Figure(figsize=(11, 2.8))
    for i, (x, name) in enumerate(((k, "K"), (v, "V"))):
        ax = fig.add_subplot(1, 2, i + 1)
        amax = x[:, 0].abs().amax(0)
        ax.bar(range(len(amax)), amax.tolist(), color="#4c72b0" if name == "K" else "#55a868")
        ax.set_title(f"layer {layer}, head 0: max |{name}| per channel over {x.shape[0]} tokens",
                     fontsize=10)
        ax.set_xlabel("channel (head_dim)")
    fig.tight_layout()
    return fig


def budget_figure(rows: list[dict]) -> Figure:
    """Same KV bytes, each format: requests running at once, and output tokens per second."""
    fig = Figure(figsize=(10, 2.8))
    names = [r["kv_cache_dtype"] for r in rows]
    for i, (key, label) in enumerate((("peak_concurrency", "requests running at once (peak)"),
                                      ("output_tok_s", "output tokens / s"))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.bar(names, [r[key] for r in rows], color=[COLORS[n] for n in names])
        for j, r in enumerate(rows):
            ax.text(j, r[key], f"{r[key]:.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_title(label, fontsize=10)
    fig.tight_layout()
    return fig


def accuracy_figure(rows: list[dict]) -> Figure:
    """KL divergence from the full-precision cache and greedy outputs left identical, per format."""
    rows = [r for r in rows if r["kv_cache_dtype"] != "auto"]
    names = [r["kv_cache_dtype"] for r in rows]
    fig = Figure(figsize=(10, 2.8))
    ax = fig.add_subplot(1, 2, 1)
    ax.bar(names, [max(r["kl_mean"], 1e-9) for r in rows], color=[COLORS[n] for n in names])
    ax.set_yscale("log")
    ax.set_title("mean KL(fp32 || format), next-token distributions", fontsize=10)
    ax = fig.add_subplot(1, 2, 2)
    ax.bar(names, [100 * r["identical_share"] for r in rows], color=[COLORS[n] for n in names])
    ax.set_ylim(0, 105)
    ax.set_title("greedy outputs identical to fp32's (%)", fontsize=10)
    fig.tight_layout()
    return fig
