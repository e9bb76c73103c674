"""Rung 14's tiled product (layers/tiled.py, csrc/tiled.cpp): against F.linear in fp32 and bf16
on shapes that exercise every tail (rows not a multiple of the 8-row tile, columns not a
multiple of the 48-column panel or of 16), with bias and residual; behind ``linear_backend=
"tiled"`` (gemv up to 8 rows); inline in a compiled graph; in the engine, greedy tokens
against Hugging Face's. Skipped where the kernel cannot run (no compiler, no AVX-512)."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from conftest import assert_greedy_match, graph_ops, hf_greedy, random_prompts
from minillm import LLM, SamplingParams
from minillm.layers import gemv, tiled
from minillm.layers.linear import Linear, get_linear_kernel

pytestmark = pytest.mark.skipif(torch.float32 not in tiled.dtypes(),
                                reason=f"no tiled kernel here: {tiled.why_not('cpu', torch.float32)}")


def case(rows, out, inp, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + 31 * rows + out)
    x, w = torch.randn(rows, inp, generator=g), torch.randn(out, inp, generator=g)
    b, r = torch.randn(out, generator=g), torch.randn(rows, out, generator=g)
    return x.to(dtype), w.to(dtype), b, r.to(dtype)


def exact(x, w, b=None, r=None):
    """The product of the same numbers in float64: what both kernels round differently."""
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    return y if r is None else y + r.double()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), out=st.integers(1, 130), inp=st.integers(1, 80),
       extras=st.booleans())
def test_fp32_products_against_float64(rows, out, inp, extras):
    x, w, b, r = case(rows, out, inp)
    bias, res = (b, r) if extras else (None, None)
    got = tiled.tiled(x, tiled.load().pack(w), bias, res)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), exact(x, w, bias, res), rtol=1e-5, atol=1e-4)


# SmolLM2's products (960 = 20 panels, 49152 the vocabulary's), a panel's 16- and 1-wide tails
@pytest.mark.parametrize("rows", [1, 9, 46, 300])
@pytest.mark.parametrize("out,inp", [(960, 576), (576, 1536), (49, 64), (33, 17)])
def test_fp32_shapes_of_a_step_and_of_a_prefill(rows, out, inp):
    x, w, b, r = case(rows, out, inp)
    got = tiled.tiled(x, tiled.load().pack(w), b, r)
    torch.testing.assert_close(got, F.linear(x, w, b) + r, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.bfloat16 not in tiled.dtypes(), reason="no AVX512-BF16 here")
@pytest.mark.parametrize("rows", [1, 8, 13, 64])
@pytest.mark.parametrize("out,inp", [(960, 576), (100, 38), (7, 2)])
def test_bf16_sums_in_fp32_and_rounds_once(rows, out, inp):
    """bf16 rows on bf16 weights (``vdpbf16ps``): products of bf16 numbers summed in fp32 and
    rounded to bf16 once, after the bias and residual: within one bf16 rounding of the exact
    sum of the same numbers."""
    x, w, b, r = case(rows, out, inp, torch.bfloat16)
    got = tiled.tiled(x, tiled.load().pack(w), b, r)
    assert got.dtype == torch.bfloat16
    want = exact(x, w, b, r)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -8, atol=1e-2 * want.abs().max())


def test_leading_dimensions_empty_batches_and_bad_inputs():
    x, w, b, r = case(6, 40, 24)
    panels = tiled.load().pack(w)
    assert panels.shape == w.shape          # the weight's shape, the values in panel order
    y = tiled.tiled(x.view(2, 3, 24), panels, b, r.view(2, 3, 40))
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.view(6, 40), F.linear(x, w, b) + r, rtol=1e-5, atol=1e-5)
    assert tiled.tiled(x[:0], panels).shape == (0, 40)
    with pytest.raises(RuntimeError, match=r"panels: \[out, in\] matching x"):
        tiled.tiled(torch.randn(2, 23), panels)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        tiled.tiled(x.double(), panels)
    with pytest.raises(RuntimeError, match="bias: 3 values for 40 outputs"):
        tiled.tiled(x, panels, torch.ones(3))
    with pytest.raises(RuntimeError, match="takes fp32 weights"):
        tiled.load().pack(w.half())


def test_the_backend_streams_few_rows_and_tiles_more():
    kernel = get_linear_kernel("tiled", "cpu", torch.float32)
    assert isinstance(kernel, gemv.GemvLinear) and isinstance(kernel.base, tiled.TiledLinear)
    assert kernel.name == "tiled"
    _, w, b, _ = case(1, 50, 72)
    lin = Linear(w, b, kernel)
    for rows in (1, gemv.MAX_ROWS, gemv.MAX_ROWS + 1, 40):
        x, _, _, r = case(rows, 50, 72, seed=rows)
        got = lin(x, residual=r)
        want = (gemv.gemv(x, w, None, b, r) if rows <= gemv.MAX_ROWS
                else tiled.tiled(x, lin.packed[1], b, r))
        torch.testing.assert_close(got, want, rtol=0, atol=0)      # the kernel named, exactly
        torch.testing.assert_close(got, F.linear(x, w, b) + r, rtol=1e-4, atol=1e-4)
    assert pickle.loads(pickle.dumps(lin))(x).shape == (40, 50)    # repacked where unpickled


def test_where_it_cannot_run_one_warning_names_why():
    with pytest.warns(RuntimeWarning, match="linear_backend='tiled' cannot run here: .*float16"):
        kernel = get_linear_kernel("tiled", "cpu", torch.float16)
    assert isinstance(kernel, gemv.GemvLinear) and not isinstance(kernel.base, tiled.TiledLinear)


def test_a_compiled_graph_calls_the_tiled_operator_inline():
    """Rung 14's graph: the many-row products are ``minillm.tiled_mm`` nodes on the layer's
    panels (a plain buffer, no ``packed_linear`` box), both in a bucket and in the graph
    compiled for any batch size."""
    from minillm.engines.r14_compiled.graph import GraphLinear
    _, w, b, _ = case(1, 48, 64)
    lin, linears = Linear(w, b, get_linear_kernel("tiled", "cpu", torch.float32)), []
    node = GraphLinear(lin, linears)
    assert linears == []            # nothing for the step's context to carry
    for rows in (gemv.MAX_ROWS + 1, 24):
        x, _, _, r = case(rows, 48, 64, seed=rows)
        ops = graph_ops(node, x, r)
        assert any("minillm.tiled_mm" in o for o in ops), ops
        assert not any("packed_linear" in o or "step_linear" in o for o in ops), ops
        torch.testing.assert_close(torch.compile(node, fullgraph=True)(x, r), lin(x, residual=r),
                                   rtol=0, atol=0)


def test_engine_on_tiled_matches_hugging_face(tiny):
    prompts = random_prompts(12, seed=6)        # 12 decode rows: the tiled kernel's
    llm = LLM(tiny, engine="paged", linear_backend="tiled", max_num_seqs=12)
    assert llm.engine.runner.net.linear_kernel.name == "tiled"
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)
    for i, out in enumerate(llm.generate(prompts, params, progress=False)):
        assert_greedy_match(out.token_ids, hf_greedy(tiny, prompts[i], 10), label=f"tiled {i}")
