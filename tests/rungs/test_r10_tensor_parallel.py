"""Rung 10's split (engines/r10_tensor/shard.py), checked in one process: T ranks' column-parallel
heads and MLP units, their row-parallel outputs summed (what the all-reduce does), give the
whole model's hidden states -- equal to Hugging Face's, layer by layer. The distributed runtime
is tested in test_r10_tensor_parallel_engine.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm.layers.linear import get_linear_kernel
from minillm.core.model import PagedLlama
from minillm.engines.r10_tensor.shard import head_split, shard_layer


def attention(net: PagedLlama, w, h, cos, sin, num_heads: int, num_kv_heads: int):
    """One layer's attention of a single causal sequence, before the o projection: [n, heads·D]."""
    D = net.head_dim
    qkv = w.qkv(net.rms_norm(h, w.input_norm))
    qk = net.rope(qkv[:, :(num_heads + num_kv_heads) * D].view(-1, num_heads + num_kv_heads, D),
                  cos, sin)
    q, k = qk[:, :num_heads], qk[:, num_heads:]
    v = qkv[:, (num_heads + num_kv_heads) * D:].view(-1, num_kv_heads, D)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], is_causal=True,
                                         scale=net.scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(len(h), num_heads * D)


def mlp(net: PagedLlama, w, h):
    gate, up = w.gate_up(net.rms_norm(h, w.post_norm)).chunk(2, dim=-1)
    return w.down(F.silu(gate) * up)


@pytest.mark.parametrize("world", [1, 2, 4])      # tiny-llama: 4 heads, 2 KV heads (4: replicas)
def test_shards_summed_give_the_whole_model_and_hf(world):
    from minillm import load_model
    model = load_model("tiny-llama", dtype=torch.float64)
    kernel = get_linear_kernel("torch", model.device, model.dtype)
    net = PagedLlama(model.hf_model, kernel)
    H, KVH, D = net.num_heads, net.num_kv_heads, net.head_dim
    splits = [head_split(H, KVH, world, r) for r in range(world)]
    shards = [[shard_layer(w, s, H, KVH, D, kernel) for w in net.layers] for s in splits]
    ids = torch.tensor([5, 9, 31, 7, 300, 12, 44, 2, 61, 90])
    pos = torch.arange(len(ids))
    cos, sin = net.cos[pos], net.sin[pos]
    with torch.inference_mode():
        hf = model.hf_model(ids[None], output_hidden_states=True).hidden_states
        h = net.embed_tokens(ids)
        for i, w in enumerate(net.layers):
            parts = [attention(net, rank[i], h, cos, sin, len(s.q_heads), len(s.kv_heads))
                     for s, rank in zip(splits, shards)]
            h = h + sum(rank[i].o(a) for a, rank in zip(parts, shards))     # all-reduce
            h = h + sum(mlp(net, rank[i], h) for rank in shards)             # all-reduce
            whole = hf[i + 1][0] if i + 1 < len(net.layers) else None
            if whole is not None:
                assert torch.allclose(h, whole, atol=1e-10), f"layer {i}, T={world}"
        assert torch.allclose(net.final_hidden(h), hf[-1][0], atol=1e-10)


def test_each_rank_reads_the_kv_heads_its_query_heads_use():
    for H, KVH, T in ((4, 2, 2), (4, 2, 4), (9, 3, 3), (8, 2, 8), (8, 8, 4)):
        for r in range(T):
            s = head_split(H, KVH, T, r)
            assert {h // (H // KVH) for h in s.q_heads} <= set(s.kv_heads), (H, KVH, T, r)
            assert s.kv_replicas == max(1, T // KVH)


@pytest.mark.parametrize("H,KVH,T,why", [(9, 3, 2, "9 attention heads"),
                                         (8, 6, 4, "6 KV heads"), (4, 2, 0, "ranks")])
def test_splits_that_cannot_be_made_are_errors_naming_both_numbers(H, KVH, T, why):
    with pytest.raises(ValueError, match=why):
        head_split(H, KVH, T, 0)
