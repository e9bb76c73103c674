"""Exercise 10 — tensor parallelism: ``head_split`` (which heads a rank computes), ``shard_layer``
(the column/row split of one layer) and ``RowParallelLinear.__call__`` (where the all-reduce goes
and who adds the residual), in ``minillm/engines/r10_tensor/shard.py``.

Graded against a reference written here from the definition, then in one process (T ranks'
slices, their row-parallel outputs summed, must equal the whole layer, Qwen2's q/k/v bias
included), then end to end: the engine with T = 2 and T = 4 processes must give the single-process
engine's tokens. (The spawned ranks 1..T-1 import the package's own module; rank 0 runs yours, so
a split that disagrees with the reference's shows in the tokens.)
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.core.linear import Linear, get_linear_kernel
from minillm.core.model import PagedLlama
from minillm.engines.r10_tensor.shard import RowParallelLinear, head_split, shard_layer


def reference_split(H: int, KVH: int, T: int, r: int):
    """(query heads, KV heads, replicas) of rank r, or None where the split cannot be made."""
    if H % T or (KVH % T and T % KVH):
        return None
    q = list(range(r * H // T, (r + 1) * H // T))
    if KVH % T == 0:
        return q, list(range(r * KVH // T, (r + 1) * KVH // T)), 1
    return q, [r // (T // KVH)], T // KVH


@settings(max_examples=80, deadline=None)
@given(kvh=st.sampled_from([1, 2, 3, 4, 6, 8]), group=st.sampled_from([1, 2, 3, 4]),
       T=st.sampled_from([1, 2, 3, 4, 6, 8]))
def test_head_split_matches_the_definition(kvh, group, T):
    H = kvh * group
    for r in range(T):
        want = reference_split(H, kvh, T, r)
        if want is None:
            with pytest.raises(ValueError):
                head_split(H, kvh, T, r)
            continue
        s = head_split(H, kvh, T, r)
        assert (list(s.q_heads), list(s.kv_heads), s.kv_replicas) == want, \
            f"H={H}, KVH={kvh}, T={T}, rank {r}"
        # every query head's KV head is on the same rank
        assert {h // group for h in s.q_heads} <= set(s.kv_heads)


def test_head_split_rejects_ranks_that_do_not_exist():
    for T, r in ((2, 2), (2, -1), (0, 0)):
        with pytest.raises(ValueError):
            head_split(4, 2, T, r)


@pytest.fixture(scope="module")
def net64():
    from minillm import load_model
    model = load_model("tiny-llama", dtype=torch.float64)
    return model, PagedLlama(model.hf_model, get_linear_kernel("torch", model.device, model.dtype))


def attention(net, w, h, pos, heads, kv_heads):
    D = net.head_dim
    qkv = w.qkv(net.rms_norm(h, w.input_norm))
    qk = net.rope(qkv[:, :(heads + kv_heads) * D].view(-1, heads + kv_heads, D), net.cos[pos],
                  net.sin[pos])
    v = qkv[:, (heads + kv_heads) * D:].view(-1, kv_heads, D)
    out = F.scaled_dot_product_attention(qk[:, :heads].transpose(0, 1)[None],
                                         qk[:, heads:].transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], is_causal=True, scale=net.scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).reshape(len(h), heads * D)


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_summed_slices_equal_the_whole_layer(net64, T, bias):
    model, net = net64
    H, KVH, D = net.num_heads, net.num_kv_heads, net.head_dim
    w = net.layers[0]
    if bias:      # Qwen2 adds a q/k/v bias: each rank keeps the rows of its heads
        g = torch.Generator().manual_seed(1)
        w = replace(w, qkv=Linear(w.qkv.weight, torch.randn(w.qkv.out_features, generator=g,
                                                           dtype=torch.float64), net.linear_kernel))
    ids = torch.tensor([5, 9, 31, 7, 300, 12, 44, 2, 61])
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        h = net.embed_tokens(ids)
        whole_attn = w.o(attention(net, w, h, pos, H, KVH))
        x = net.rms_norm(h, w.post_norm)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        whole_mlp = w.down(F.silu(gate) * up)
        attn_sum = mlp_sum = 0
        for r in range(T):
            s = head_split(H, KVH, T, r)
            part = shard_layer(w, s, H, KVH, D, net.linear_kernel)
            rows = (len(s.q_heads) + 2 * len(s.kv_heads)) * D
            assert part.qkv.weight.shape == (rows, w.qkv.weight.shape[1]), \
                f"rank {r}'s qkv: its q heads' rows, then its KV heads' k rows and v rows"
            assert part.o.weight.shape == (w.o.weight.shape[0], len(s.q_heads) * D), \
                f"rank {r}'s o: the columns that read its heads"
            assert (part.qkv.bias is None) == (not bias)
            attn_sum = attn_sum + part.o(attention(net, part, h, pos, len(s.q_heads),
                                                   len(s.kv_heads)))
            g_, u_ = part.gate_up(x).chunk(2, dim=-1)
            mlp_sum = mlp_sum + part.down(F.silu(g_) * u_)
    assert torch.allclose(attn_sum, whole_attn, atol=1e-10), \
        f"T={T}: the ranks' attention outputs do not add up to the layer's"
    assert torch.allclose(mlp_sum, whole_mlp, atol=1e-10), \
        f"T={T}: the ranks' MLP outputs do not add up to the layer's"


class Recorder:
    """Stands in for the all-reduce: remembers what it was given, returns a marked copy."""

    def __init__(self):
        self.seen = []

    def __call__(self, y):
        self.seen.append(y.clone())
        return y + 1000.0


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_product_then_the_all_reduce_residual_on_rank_0_only(rank):
    kernel = get_linear_kernel("torch", "cpu", torch.float64)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(6, 4, generator=g, dtype=torch.float64)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    residual = torch.randn(3, 6, generator=g, dtype=torch.float64)
    reduce = Recorder()
    layer = RowParallelLinear(weight, kernel, reduce, adds_residual=rank == 0)
    out = layer(x, residual=residual)
    assert len(reduce.seen) == 1, "exactly one all-reduce per call"
    want = x @ weight.T + (residual if rank == 0 else 0)
    assert torch.allclose(reduce.seen[0], want), \
        "the all-reduce sums this rank's product (plus the residual on rank 0 only)"
    assert torch.allclose(out, want + 1000.0), "return what the all-reduce returns"
    assert torch.allclose(layer(x), x @ weight.T + 1000.0), "no residual given: none added"


@pytest.mark.parametrize("T", [2, 4])
def test_the_engine_on_T_ranks_gives_the_single_process_tokens(tiny, T):
    from minillm import SamplingParams
    from minillm.engines import create_engine
    from minillm.lab.reference import random_prompts
    from minillm.request import Request

    tight = dict(block_size=4, num_blocks=24, max_num_batched_tokens=16)
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=5, beam_width=2, ignore_eos=True)] * 2
    prompts = random_prompts(len(params), seed=10)

    def run(engine, tag):
        result = engine.run([Request(list(p), q, request_id=f"{tag}{i}")
                             for i, (p, q) in enumerate(zip(prompts, params))])
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [(o.token_ids, o.samples) for o in result.outputs]

    want = run(create_engine("paged", tiny, **tight), "ref")
    engine = create_engine("paged", tiny, tensor_parallel_size=T, pipeline_timeout_s=30, **tight)
    try:
        assert run(engine, "tp") == want, f"T={T}: the tokens differ from one process's"
    finally:
        engine.close()
