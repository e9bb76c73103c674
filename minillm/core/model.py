"""minillm's own forward pass for the Llama family (and Qwen2, which adds q/k/v biases).

Why not keep calling the Hugging Face module as rungs 0-2 do? Its attention expects each
sequence's KV as one contiguous tensor. A paged engine needs attention that reads K/V through a
block table, and a batch that is one flat list of tokens from many sequences (some decoding one
token, some prefilling a chunk). So we read HF's weights and write the forward ourselves — in
~100 lines, as nano-vllm and gpt-fast do. (Notebook 03_block_manager.)

Shapes: a step's tokens are flat, ``[T]``; hidden states are ``[T, hidden]``. Two HF matmuls are
fused for speed (q/k/v into one, gate/up into one): same math, fewer passes over the activations.
Every matrix product is a ``Linear`` (linear.py): the kernel that computes it (F.linear, or oneDNN
on weights reordered once, the CPU default) is chosen when the model is built (notebook 04).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from ..layers.attention.reference import AttentionMetadata, paged_attention
from ..layers.fused import layer_ops, rope_heads
from ..layers.linear import Linear, gather_packed, get_linear_kernel


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear                   # weight [(H + 2*KVH) * D, hidden] (+ Qwen2's bias)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear               # weight [2 * intermediate, hidden]
    down: Linear


class PagedLlama:
    """A functional Llama/Qwen2 decoder that reads K/V from paged pools."""

    def __init__(self, hf_model: torch.nn.Module, linear_kernel=None, ops=None):
        """``linear_kernel``: what computes the matrix products (``get_linear_kernel``'s choice
        for the model's device and dtype by default); ``ops``: the layer's elementwise steps
        (fused.py; ``layer_ops``' choice by default)."""
        c = hf_model.config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
        self.embed = sd["model.embed_tokens.weight"]
        k = self.linear_kernel = linear_kernel or get_linear_kernel(None, self.embed.device,
                                                                    self.embed.dtype)
        # tied to the embedding or not: the same Linear either way
        self.lm_head = Linear(hf_model.get_output_embeddings().weight.detach(), None, k)
        self.final_norm = sd["model.norm.weight"]
        self.layers = [self._layer(sd, f"model.layers.{i}.", k)
                       for i in range(c.num_hidden_layers)]
        # int8 codes and other copies of the weights on huge pages: one row streams them all
        gather_packed([self.lm_head] + [lin for w in self.layers
                                        for lin in (w.qkv, w.o, w.gate_up, w.down)])
        self.cos, self.sin = self._rope_tables(hf_model, c.max_position_embeddings)
        self.ops = ops or layer_ops(self.embed.dtype, self.embed.device)   # norm, RoPE, SiLU

    @staticmethod
    def _layer(sd: dict, p: str, kernel) -> LayerWeights:
        a = p + "self_attn."
        bias = [sd.get(a + n + "_proj.bias") for n in "qkv"]
        return LayerWeights(
            input_norm=sd[p + "input_layernorm.weight"],
            qkv=Linear(torch.cat([sd[a + n + "_proj.weight"] for n in "qkv"]),
                       torch.cat(bias) if bias[0] is not None else None, kernel),
            o=Linear(sd[a + "o_proj.weight"], None, kernel),
            post_norm=sd[p + "post_attention_layernorm.weight"],
            gate_up=Linear(torch.cat([sd[p + "mlp.gate_proj.weight"],
                                      sd[p + "mlp.up_proj.weight"]]), None, kernel),
            down=Linear(sd[p + "mlp.down_proj.weight"], None, kernel))

    @staticmethod
    def _rope_tables(hf_model, max_len: int):
        """cos/sin for every position, from HF's own rotary module so theta and any RoPE scaling
        (llama3, linear, dynamic...) match the reference exactly."""
        rotary = hf_model.model.rotary_emb
        pos = torch.arange(max_len, device=rotary.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, rotary.inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        dtype = hf_model.model.embed_tokens.weight.dtype
        scaling = getattr(rotary, "attention_scaling", 1.0)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * w, in fp32 like HF (one fused op instead of five)."""
        return self.ops.rms_norm(x, w, self.eps)

    rope = staticmethod(rope_heads)    # x [T, heads, D] rotated (fused.py)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the step."""
        h = self.embed_tokens(input_ids)
        h = self.forward_layers(h, positions, meta, kv_caches, backend, 0, len(self.layers))
        return self.final_hidden(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only the rows that need a next token are projected: the vocab matmul is expensive."""
        return self.lm_head(hidden).float()

    def with_layers(self, layers: list[LayerWeights], num_heads: int,
                    num_kv_heads: int) -> "PagedLlama":
        """The same model computing other layer weights with other head counts (embeddings,
        norms, head and RoPE tables shared, not copied): a tensor-parallel rank's share of it
        (rung 10, ``minillm/engines/r10_tensor/shard.py``; notebook 10)."""
        net = copy.copy(self)
        net.layers, net.num_heads, net.num_kv_heads = layers, num_heads, num_kv_heads
        return net

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    # --- the pieces of ``forward``; a pipeline stage (rung 7, minillm/engines/r7_pipeline) runs
    # only its slice of the layers: the first stage embeds, the last applies the final norm.
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def forward_layers(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend, start: int,
                       end: int) -> torch.Tensor:
        """Hidden states [T, hidden] after layers [start, end); ``kv_caches`` holds the pools of
        those layers only (``kv_caches[0]`` is layer ``start``'s)."""
        cos, sin = self.cos[positions], self.sin[positions]
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        for w, (k_cache, v_cache) in zip(self.layers[start:end], kv_caches):
            x = self.rms_norm(h, w.input_norm)
            qkv = w.qkv(x)
            q, k = self.ops.rope(qkv, cos, sin, H, KVH)
            v = qkv[:, (H + KVH) * D:].view(-1, KVH, D)
            with record_function("minillm::attention"):
                attn = paged_attention(backend, q, k, v, k_cache, v_cache, meta, self.scale)
            h = w.o(attn.reshape(-1, H * D), residual=h)           # h + attn @ W_o.T
            x = self.rms_norm(h, w.post_norm)
            h = w.down(self.ops.silu_mul(w.gate_up(x)), residual=h)
        return h

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(h, self.final_norm)
