"""Rung 14's streamed one-row product (layers/gemv.py, csrc/gemv.cpp): against F.linear on fp32
and on widened int8 weights, at 1..8 rows (the kernel) and past them (the kernel it extends, the
same numbers bit for bit); in the engine, fp32 tokens against Hugging Face's and int8 decodes
against the widen-then-BLAS path. Skipped where the extension cannot build (no compiler)."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_greedy_match, graph_ops, hf_greedy, random_prompts
from minillm import LLM, SamplingParams
from minillm.layers import gemv
from minillm.layers.linear import Linear, OneDNNLinear, TorchLinear, get_linear_kernel
from minillm.layers.quant import Int8Linear, quantize_per_channel

pytestmark = pytest.mark.skipif(gemv.load() is None, reason=f"no gemv kernel: {gemv.error()}")


def case(rows, out, inp, seed=0):
    g = torch.Generator().manual_seed(seed + rows * 7 + out)
    return (torch.randn(rows, inp, generator=g), torch.randn(out, inp, generator=g),
            torch.randn(out, generator=g), torch.randn(rows, out, generator=g))


# sizes with the 32-, 8- and 1-wide tails of the inner loop, and SmolLM2's shapes
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("out,inp", [(7, 37), (96, 40), (1536, 576), (576, 1536)])
def test_fp32_and_int8_products_against_f_linear(rows, out, inp):
    x, w, b, r = case(rows, out, inp)
    torch.testing.assert_close(gemv.gemv(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gemv.gemv(x, w, None, b, r), F.linear(x, w, b) + r,
                               rtol=1e-4, atol=1e-4)
    q, s = quantize_per_channel(w)
    want = F.linear(x, q.float()) * s + b + r
    torch.testing.assert_close(gemv.gemv(x, q, s, b, r), want, rtol=1e-4, atol=1e-4)


def test_leading_dimensions_and_a_strided_residual_come_back():
    x, w, b, r = case(4, 24, 40)
    x3 = x.view(2, 2, 40)
    res = torch.randn(24, 4).t()          # [4, 24], not contiguous
    y = gemv.gemv(x3, w, None, b, res.reshape(2, 2, 24))
    assert y.shape == (2, 2, 24)
    torch.testing.assert_close(y.view(4, 24), F.linear(x, w, b) + res, rtol=1e-4, atol=1e-4)


def test_bad_inputs_are_refused_by_name():
    x, w, _, _ = case(2, 8, 16)
    with pytest.raises(RuntimeError, match="w: \\[out, in\\] matching x"):
        gemv.gemv(x, torch.randn(8, 15))
    with pytest.raises(RuntimeError, match="w: fp32, bf16 or int8"):
        gemv.gemv(x, w.half())
    with pytest.raises(RuntimeError, match="x: \\[rows, in\\] fp32 or bf16"):
        gemv.gemv(x.half(), w)
    with pytest.raises(RuntimeError, match="scale"):
        gemv.gemv(x, w.to(torch.int8), torch.ones(7))
    with pytest.raises(RuntimeError, match="residual: .* in x's dtype"):
        torch.ops.minillm.gemv(x, w, None, None, torch.ones(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="w: \\[out, in\\] int8"):
        torch.ops.minillm.gemv_w8a8(x, w, torch.ones(8), None, None)


@pytest.mark.parametrize("base", [OneDNNLinear, TorchLinear])
def test_fp32_kernel_streams_few_rows_and_hands_more_to_its_base(base):
    if base is OneDNNLinear and get_linear_kernel(None, "cpu", torch.float32).name != "onednn":
        pytest.skip("oneDNN does not run here")
    _, w, b, _ = case(1, 48, 64)
    lin = Linear(w, b, gemv.GemvLinear(base()))
    ref = Linear(w, b, base())
    for rows in (1, 8, 9, 33):
        x, _, _, r = case(rows, 48, 64, seed=rows)
        got = lin(x, residual=r)
        if rows > gemv.MAX_ROWS:      # the base computes it: the same numbers exactly
            torch.testing.assert_close(got, ref(x, residual=r), rtol=0, atol=0)
        torch.testing.assert_close(got, F.linear(x, w, b) + r, rtol=1e-4, atol=1e-4)
    assert pickle.loads(pickle.dumps(lin))(x).shape == (33, 48)


def test_int8_picks_the_streamed_kernel_wherever_it_builds():
    """Decode rows on int8 weights stream (faster than widening on AVX2, than torch's AVX-512
    int8pack kernel on AVX-512: docs/rungs/14_compiled.md); more rows take Int8Linear's path."""
    kernel = get_linear_kernel("int8", "cpu", torch.float32)
    assert isinstance(kernel, gemv.Int8GemvLinear) and isinstance(kernel, gemv.StreamedLinear)
    assert not kernel.traceable and kernel.path is None     # many rows: int8_path decides
    _, w, b, _ = case(1, 40, 72)
    lin = Linear(w, b, gemv.Int8GemvLinear())
    for rows in (1, 8, 20):
        x, _, _, r = case(rows, 40, 72, seed=rows)
        want = Linear(w, b, Int8Linear("dequant"))(x, residual=r)
        torch.testing.assert_close(lin(x, residual=r), want, rtol=1e-4, atol=1e-4)
    bf = torch.randn(3, 72).bfloat16()      # not fp32: Int8Linear's own paths
    assert Linear(w.bfloat16(), None, gemv.Int8GemvLinear())(bf).dtype == torch.bfloat16


def test_engine_on_gemv_matches_hugging_face(tiny):
    prompts = random_prompts(4, seed=5)
    llm = LLM(tiny, engine="paged", linear_backend="gemv", max_num_seqs=4)
    assert llm.engine.runner.net.linear_kernel.name == "gemv"
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    for i, out in enumerate(llm.generate(prompts, params, progress=False)):
        assert_greedy_match(out.token_ids, hf_greedy(tiny, prompts[i], 12), label=f"gemv {i}")


def test_engine_int8_decodes_like_the_widening_path(tiny, monkeypatch):
    """Decode rows through the streamed kernel, prefill through Int8Linear: the same tokens as
    an engine whose int8 layers all widen (summation order apart: first tokens agree)."""
    prompts = random_prompts(6, seed=9)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)
    fast = LLM(tiny, engine="paged", block_size=4, quantization="int8")
    got = [o.token_ids for o in fast.generate(prompts, params, progress=False)]
    monkeypatch.setattr(gemv, "int8_kernel", lambda device: Int8Linear("dequant"))
    slow = LLM(tiny, engine="paged", block_size=4, quantization="int8")
    want = [o.token_ids for o in slow.generate(prompts, params, progress=False)]
    prefix = sum(next((i for i, (a, c) in enumerate(zip(g, h)) if a != c), len(g))
                 for g, h in zip(got, want))
    assert prefix >= 0.9 * sum(map(len, want)), (got, want)


@pytest.mark.parametrize("kernel,dtype", [("gemv", torch.float32), ("int8", torch.float32),
                                          ("gemv", torch.bfloat16)])
def test_a_compiled_graph_calls_the_streamed_operator_inline(kernel, dtype):
    """Rung 14's graph: up to MAX_ROWS rows are ``minillm.gemv`` nodes on the layer's own
    tensors (no Python of ours per product); more rows are the many-row kernel's: the opaque
    ``packed_linear`` box for int8's, traced inline for a traceable base (torch's F.linear
    here; the tiles, test_tiled.py). Both compute what the eager kernel does."""
    from minillm.engines.r14_compiled.graph import GraphLinear
    from minillm.engines.r14_compiled.ops import StepContext, step_context
    _, w, b, _ = case(1, 48, 64)
    k = gemv.GemvLinear(TorchLinear()) if kernel == "gemv" else gemv.Int8GemvLinear()
    lin, linears = Linear(w.to(dtype), b.to(dtype), k), []
    node = GraphLinear(lin, linears)
    ctx = StepContext(rows=0, caches=[], backend=None, slot_mapping=None, block_tables=None,
                      context_lens=None, scale=1.0, linears=linears)
    many = "minillm.packed_linear" if kernel == "int8" else None
    for rows, op in ((1, "minillm.gemv"), (gemv.MAX_ROWS, "minillm.gemv"),
                     (gemv.MAX_ROWS + 1, many)):
        x = case(rows, 48, 64, seed=rows)[0].to(dtype)
        with step_context(ctx):
            ops = graph_ops(node, x)
            torch.testing.assert_close(torch.compile(node, fullgraph=True)(x), lin(x),
                                       rtol=1e-5, atol=1e-5)
        assert op is None or any(op in o for o in ops), (rows, ops)
        others = {"minillm.gemv", "minillm.packed_linear"} - {op}
        assert not any(other in o for o in ops for other in others), (rows, ops)


W8A8_SHAPES = [(7, 37), (96, 64), (40, 200), (1536, 576), (576, 1536)]   # chunk tails and SmolLM2's


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("out,inp", W8A8_SHAPES)
def test_w8a8_rows_compute_w8a8_linear_s_product(rows, out, inp):
    """The streamed w8a8 kernel (VNNI where built with it, a scalar loop elsewhere) against
    ``W8A8Linear`` (torch._int_mm): the same per-token codes and exact integer sums, so the
    results agree to fp32 rounding, bias and residual included."""
    from minillm.layers.quant import W8A8Linear
    x, w, b, r = case(rows, out, inp)
    k, ref = gemv.W8A8GemvLinear(), W8A8Linear()
    got = k.stream(x, k.pack(w), b, r)
    want = ref(x, ref.pack(w), b, r)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert relative_error(got, F.linear(x, w, b) + r) < 0.05     # and near fp32's product


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("out,inp", [(7, 37), (96, 100), (1536, 576)])
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_bf16_rows_on_bf16_and_int8_weights(rows, out, inp, weights):
    """bf16 activations (a bf16 model's decode rows): the kernel sums in fp32 and rounds y once,
    after the residual's add -- within one bf16 rounding of the fp32 product of the same
    numbers, and the layer stays in bf16. (100 = 64 + 32 + 4: every tail of the AVX512-BF16
    loop, where the CPU has it.)"""
    x, w, b, r = (t.bfloat16() for t in case(rows, out, inp))
    if weights == "bf16":
        lin = Linear(w, None, gemv.GemvLinear(TorchLinear()))
        exact = x.float() @ w.float().T + r.float()
    else:
        lin = Linear(w, None, gemv.Int8GemvLinear())
        q, s = lin.packed
        exact = (x.float() @ q.float().T) * s.float() + r.float()
    got = lin(x, residual=r)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-3)
    if weights == "bf16":       # and a bias
        got = gemv.gemv(x, w, None, b, r)
        torch.testing.assert_close(got.float(), exact + b.float(), rtol=2 ** -8, atol=1e-3)


def test_the_bf16_dot_product_path_is_built_where_the_cpu_has_it():
    import platform
    from pathlib import Path
    info = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or not info.exists():
        pytest.skip("reads /proc/cpuinfo's x86 flags")
    flags = set(next(line for line in info.read_text().splitlines()
                     if line.startswith("flags")).split())
    assert gemv.load().has_bf16_dot() == ({"avx512_bf16", "avx512bw"} <= flags)


def test_engine_on_gemv_in_bf16_decodes_like_the_oneDNN_engine():
    """A bf16 model's decode rows through the kernel (its weights bf16 too), prefill through the
    base: the greedy tokens of the default bf16 engine, summation order apart."""
    from minillm.models import load_model
    bf16 = load_model("tiny-llama", dtype=torch.bfloat16)
    prompts = random_prompts(4, seed=6)
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0)
    fast = LLM(bf16, engine="paged", linear_backend="gemv", max_num_seqs=4)
    assert fast.engine.runner.net.linear_kernel.name == "gemv"
    got = [o.token_ids for o in fast.generate(prompts, params, progress=False)]
    want = [o.token_ids for o in LLM(bf16, engine="paged", max_num_seqs=4).generate(
        prompts, params, progress=False)]
    prefix = sum(next((i for i, (a, c) in enumerate(zip(g, h)) if a != c), len(g))
                 for g, h in zip(got, want))
    assert prefix >= 0.75 * sum(map(len, want)), (got, want)
