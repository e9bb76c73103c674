"""Exercise 10 — tensor parallelism: ``head_split`` (which heads a rank computes), ``shard_layer``
(the column/row split of one layer) and ``RowParallelLinear.__call__`` (where the all-reduce goes
and who adds the residual), in ``minillm/engines/r10_tensor/shard.py``.

Graded against a reference written here from the definition, then layer by layer (the slices
your ``shard_layer`` cuts, sent back here: T ranks' row-parallel outputs summed must equal the whole
layer, Qwen2's q/k/v bias included), then end to end: the engine with T = 2 and T = 4 processes,
started from your process (every rank loads your file), must give the single-process engine's
tokens, computed here with the package's own code.

Every call of your functions happens in your process (``probe_*``, the ``student`` fixture); what
they return (head lists, weight slices, outputs, tokens) is judged here.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from minillm.layers.linear import Linear, get_linear_kernel
from minillm.core.model import PagedLlama
from minillm.engines.r10_tensor.shard import RowParallelLinear, head_split, shard_layer

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
_NET: dict = {}


def reference_split(H: int, KVH: int, T: int, r: int):
    """(query heads, KV heads, replicas) of rank r, or None where the split cannot be made."""
    if T < 1 or not 0 <= r < T or H % T or (KVH % T and T % KVH):
        return None
    q = list(range(r * H // T, (r + 1) * H // T))
    if KVH % T == 0:
        return q, list(range(r * KVH // T, (r + 1) * KVH // T)), 1
    return q, [r // (T // KVH)], T // KVH


def probe_head_split(cases: list) -> list:
    """``head_split(H, KVH, T, r)`` for each case: ("ok", q heads, KV heads, replicas) or
    ("raised", the exception's type name)."""
    out = []
    for case in cases:
        try:
            s = head_split(*case)
            out.append(("ok", [int(h) for h in s.q_heads], [int(h) for h in s.kv_heads],
                        int(s.kv_replicas)))
        except NotImplementedError:
            raise                     # a stub: the test fails with its message
        except Exception as e:        # noqa: BLE001 - judged by the grader: ValueError or not
            out.append(("raised", type(e).__name__))
    return out


def judge_splits(cases: list, got: list) -> None:
    for (H, kvh, T, r), answer in zip(cases, got, strict=True):
        want = reference_split(H, kvh, T, r)
        where = f"head_split(num_heads={H}, num_kv_heads={kvh}, world={T}, rank={r})"
        if want is None:
            assert answer == ("raised", "ValueError"), (
                f"{where} returned {answer[1:]}: this split cannot be made (T must be at least 1, "
                "0 <= rank < T, T must divide the heads, and T and KVH one the other): raise "
                "ValueError")
            continue
        assert answer[0] == "ok", f"{where} raised {answer[1]}, but the split exists: {want}"
        assert tuple(answer[1:]) == want, f"{where}: got {answer[1:]}, want {want}"
        group = H // kvh
        assert {h // group for h in answer[1]} <= set(answer[2]), \
            f"{where}: a query head's KV head is on another rank"


def test_head_split_matches_the_definition(student):
    """Every (KVH, query heads per KV head, T) of a small grid, every rank (exhaustive: the grid
    is small, so no example is left to chance)."""
    cases = [(kvh * group, kvh, T, r) for kvh in (1, 2, 3, 4, 6, 8) for group in (1, 2, 3, 4)
             for T in (1, 2, 3, 4, 6, 8) for r in range(T)]
    judge_splits(cases, student.run(probe_head_split, cases))


def test_head_split_rejects_ranks_that_do_not_exist(student):
    cases = [(4, 2, 2, 2), (4, 2, 2, -1), (4, 2, 0, 0), (4, 2, -2, 0)]
    judge_splits(cases, student.run(probe_head_split, cases))


def net64():
    """The tiny Llama in float64 and its paged network, once per process (each process, the
    student's and the grader's, builds its own: the seeded weights are the same)."""
    if "net" not in _NET:
        from minillm import load_model
        model = load_model("tiny-llama", dtype=torch.float64)
        _NET["net"] = PagedLlama(model.hf_model, get_linear_kernel("torch", model.device,
                                                                   model.dtype))
    return _NET["net"]


def layer0(net, bias: bool):
    """Layer 0's weights; with ``bias``, a seeded q/k/v bias (Qwen2's) added."""
    w = net.layers[0]
    if bias:
        g = torch.Generator().manual_seed(1)
        w = replace(w, qkv=Linear(w.qkv.weight, torch.randn(w.qkv.out_features, generator=g,
                                                           dtype=torch.float64), net.linear_kernel))
    return w


def probe_shards(T: int, bias: bool) -> list:
    """Each rank's split and the slices ``shard_layer`` cuts for it, as plain tensors."""
    net = net64()
    H, KVH, D = net.num_heads, net.num_kv_heads, net.head_dim
    w, out = layer0(net, bias), []
    for r in range(T):
        s = head_split(H, KVH, T, r)
        part = shard_layer(w, s, H, KVH, D, net.linear_kernel)
        out.append(([int(h) for h in s.q_heads], [int(h) for h in s.kv_heads],
                    {"qkv": part.qkv.weight, "qkv_bias": part.qkv.bias, "o": part.o.weight,
                     "gate_up": part.gate_up.weight, "down": part.down.weight}))
    return out


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


def check_shapes(r: int, T: int, q: list, kv: list, t: dict, w, D: int) -> None:
    """Each slice's shape, with the mistake named (a slice cut along the wrong dimension would
    otherwise end in a matrix-product error)."""
    hidden, inter = w.qkv.weight.shape[1], w.gate_up.weight.shape[0] // 2
    rows, units = (len(q) + 2 * len(kv)) * D, inter // T
    checks = [("qkv", t["qkv"], (rows, hidden), "column-parallel: its q heads' rows, then its KV "
               "heads' k rows and v rows, every input column"),
              ("o", t["o"], (hidden, len(q) * D), "row-parallel: every output row, the input "
               "columns that read its heads (w.o.weight[:, cols])"),
              ("gate_up", t["gate_up"], (2 * units, hidden), "column-parallel: its units' rows "
               "of gate, then the same units' rows of up, every input column"),
              ("down", t["down"], (hidden, units), "row-parallel: every output row, the input "
               "columns of its intermediate units")]
    for name, got, want, how in checks:
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == want, (
            f"rank {r}'s {name} weight has shape {tuple(getattr(got, 'shape', ()))}, want {want} "
            f"(T={T}): {name} is {how}")


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_summed_slices_equal_the_whole_layer(student, T, bias):
    net = net64()
    H, KVH, D = net.num_heads, net.num_kv_heads, net.head_dim
    w, kernel = layer0(net, bias), net.linear_kernel
    ranks = student.run(probe_shards, T, bias)
    assert len(ranks) == T
    ids = torch.tensor([5, 9, 31, 7, 300, 12, 44, 2, 61])
    pos = torch.arange(len(ids))
    with torch.inference_mode():
        h = net.embed_tokens(ids)
        whole_attn = w.o(attention(net, w, h, pos, H, KVH))
        x = net.rms_norm(h, w.post_norm)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        whole_mlp = w.down(F.silu(gate) * up)
        attn_sum = mlp_sum = 0
        for r, (q, kv, t) in enumerate(ranks):
            check_shapes(r, T, q, kv, t, w, D)
            assert (t["qkv_bias"] is None) == (not bias), \
                f"rank {r}: the q/k/v bias is {'lost' if bias else 'made up'}"
            part = replace(w, qkv=Linear(t["qkv"], t["qkv_bias"], kernel),
                           o=Linear(t["o"], None, kernel),
                           gate_up=Linear(t["gate_up"], None, kernel),
                           down=Linear(t["down"], None, kernel))
            attn_sum = attn_sum + part.o(attention(net, part, h, pos, len(q), len(kv)))
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


def probe_row_parallel(rank: int, weight, x, residual) -> dict:
    kernel = get_linear_kernel("torch", "cpu", torch.float64)
    reduce = Recorder()
    layer = RowParallelLinear(weight, kernel, reduce, adds_residual=rank == 0)
    out = layer(x, residual=residual)
    reduced = list(reduce.seen)
    return {"out": out, "reduced": reduced, "no_residual": layer(x)}


@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_product_then_the_all_reduce_residual_on_rank_0_only(student, rank):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(6, 4, generator=g, dtype=torch.float64)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    residual = torch.randn(3, 6, generator=g, dtype=torch.float64)
    got = student.run(probe_row_parallel, rank, weight, x, residual)
    assert len(got["reduced"]) == 1, "exactly one all-reduce per call"
    want = x @ weight.T + (residual if rank == 0 else 0)
    assert torch.allclose(got["reduced"][0], want), \
        "the all-reduce sums this rank's product (plus the residual on rank 0 only)"
    assert torch.allclose(got["out"], want + 1000.0), "return what the all-reduce returns"
    assert torch.allclose(got["no_residual"], x @ weight.T + 1000.0), \
        "no residual given: none added"


TIGHT = dict(block_size=4, num_blocks=24, max_num_batched_tokens=16)


def tp_requests(tag: str) -> list:
    from minillm import SamplingParams
    from minillm.lab.reference import random_prompts
    from minillm.request import Request
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=5, beam_width=2, ignore_eos=True)] * 2
    prompts = random_prompts(len(params), seed=10)
    return [Request(list(p), q, request_id=f"{tag}{i}") for i, (p, q) in enumerate(zip(prompts,
                                                                                         params))]


def run_tokens(engine, tag: str) -> tuple:
    result = engine.run(tp_requests(tag))
    full = engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [([int(t) for t in o.token_ids], [[int(t) for t in s] for s in o.samples])
            for o in result.outputs], full


def probe_tp_engine(T: int) -> tuple:
    """The engine on one process and on T ranks, started here (the student's process: every rank
    loads the student's file)."""
    from minillm import load_model
    from minillm.engines import create_engine
    tiny = load_model("tiny-llama", dtype=torch.float32)
    single, _ = run_tokens(create_engine("paged", tiny, **TIGHT), "one")
    engine = create_engine("paged", tiny, tensor_parallel_size=T, pipeline_timeout_s=30, **TIGHT)
    try:
        return (single, *run_tokens(engine, "tp"))
    finally:
        engine.close()


@pytest.mark.parametrize("T", [2, 4])
def test_the_engine_on_T_ranks_gives_the_single_process_tokens(tiny, student, T):
    from minillm.engines import create_engine
    from minillm.lab.reference import package_reference
    single, got, full = student.run(probe_tp_engine, T)
    assert full, f"T={T}: the pool did not end full"
    assert got == single, f"T={T}: the tokens differ from one process's"
    want = package_reference(lambda: run_tokens(create_engine("paged", tiny, **TIGHT), "ref")[0])
    assert want is None or got == want, f"T={T}: the tokens differ from the package's engine"
