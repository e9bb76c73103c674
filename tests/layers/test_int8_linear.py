"""Rung 14's int8 weights (layers/quant.py): per-channel quantization's error bound, the int8
kernels against fp32 ``F.linear``, ``quantization=`` as an engine option (checked by name, w8a8
refused by name where the CPU has no int8 units), and the engine's tokens on it."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts
from minillm import LLM, SamplingParams
from minillm.layers import quant
from minillm.layers.config import ModelConfig
from minillm.layers.linear import Linear, get_linear_kernel
from minillm.layers.quant import (Int8Linear, W8A8Linear, dequantize_per_channel,
                                  quantize_per_channel, quantize_per_token, w8a8_missing)

try:
    torch._int_mm(torch.ones(2, 32, dtype=torch.int8), torch.ones(32, 8, dtype=torch.int8))
    HAS_INT_MM = True
except Exception:    # a build without the CPU int8 GEMM
    HAS_INT_MM = False


@pytest.mark.parametrize("shape", [(7, 13), (96, 40), (1, 576)])
def test_per_channel_round_trip_within_half_a_step(shape):
    """Each element comes back within half its row's step (scale / 2): round, not truncate."""
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[0])[:, None]
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (shape[0],)
    assert int(q.abs().max()) <= 127 and (q.abs().amax(1) == 127).all()   # every row uses its range
    err = (dequantize_per_channel(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()


def test_a_scale_per_channel_not_per_tensor():
    """One row 1000x larger must not flatten the small row to zero (a per-tensor scale would)."""
    w = torch.tensor([[1000.0, -500.0, 3.0], [0.01, -0.02, 0.005]])
    q, scale = quantize_per_channel(w)
    torch.testing.assert_close(scale, w.abs().amax(1) / 127)
    assert (q[1] != 0).all()
    torch.testing.assert_close(dequantize_per_channel(q, scale)[1], w[1], rtol=0.01, atol=1e-4)


def test_clamped_to_127_and_zero_rows_survive():
    w = torch.zeros(3, 8)
    w[1, 2] = -5.0
    q, scale = quantize_per_channel(w)
    assert q.min() == -127 and scale[0] == 1 and (q[0] == 0).all()
    assert torch.isfinite(dequantize_per_channel(q, scale)).all()
    xq, xs = quantize_per_token(torch.tensor([[0.5, -1.0], [300.0, 2.0]]))
    assert xq.tolist() == [[64, -127], [127, 1]] and xs.shape == (2,)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("path", ["int8pack", "dequant"])
@pytest.mark.parametrize("rows,out,inp", [(1, 96, 40), (7, 33, 576), (130, 64, 128)])
@pytest.mark.parametrize("extras", [False, True])
def test_int8_weight_only_vs_fp32(path, rows, out, inp, extras):
    """Both paths compute ``x @ dequant(q).T`` (fp32 rounding apart), within ~1% of fp32's
    product on random data; bias and residual added after."""
    g = torch.Generator().manual_seed(rows + out)
    w, x = torch.randn(out, inp, generator=g), torch.randn(rows, inp, generator=g)
    b = torch.randn(out, generator=g) if extras else None
    r = torch.randn(rows, out, generator=g) if extras else None
    lin = Linear(w, b, Int8Linear(path))
    got = lin(x, residual=r)
    q, scale = lin.packed
    exact = F.linear(x, dequantize_per_channel(q, scale), b) + (r if extras else 0)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    fp32 = F.linear(x, w, b) + (r if extras else 0)
    assert relative_error(got, fp32) < 0.01


def test_int8_pickles_and_bf16():
    w, x = torch.randn(16, 8), torch.randn(3, 8)
    lin = Linear(w, None, Int8Linear())
    copy = pickle.loads(pickle.dumps(lin))
    torch.testing.assert_close(copy(x), lin(x), rtol=0, atol=0)
    wb = torch.randn(64, 128).bfloat16()
    y = Linear(wb, None, Int8Linear())(torch.randn(5, 128).bfloat16())
    assert y.dtype == torch.bfloat16


@pytest.mark.skipif(not HAS_INT_MM, reason="no torch._int_mm on this CPU build")
@pytest.mark.parametrize("rows,out,inp", [(1, 96, 64), (17, 48, 576)])
def test_w8a8_kernel_vs_fp32(rows, out, inp):
    """The kernel's arithmetic, wherever torch._int_mm runs (the engine refuses it without
    VNNI/AMX: slow there, not wrong): ~1-2% from fp32 on random data."""
    g = torch.Generator().manual_seed(rows)
    w, x, b = (torch.randn(s, generator=g) for s in ((out, inp), (rows, inp), (out,)))
    k = W8A8Linear()
    got = k(x, k.pack(w), b)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    assert relative_error(got, F.linear(x, w, b)) < 0.02


def test_option_checked_by_name():
    assert ModelConfig(quantization="int8").linear_backend == "int8"
    assert ModelConfig().quantization is None and ModelConfig().linear_backend is None
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        ModelConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization='int8' picks the linear kernel"):
        ModelConfig(quantization="int8", linear_backend="onednn")
    with pytest.raises(ValueError, match="unknown linear_backend 'int8'"):
        ModelConfig(linear_backend="int8")          # only through quantization=


def test_w8a8_refused_with_one_line_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr(quant, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    why = w8a8_missing("cpu")
    assert "\n" not in why and "VNNI" in why and "quantization='int8'" in why
    with pytest.raises(RuntimeError, match="needs int8 dot-product instructions"):
        get_linear_kernel("w8a8", "cpu", torch.float32)


@pytest.mark.skipif(not HAS_INT_MM, reason="no torch._int_mm on this CPU build")
def test_w8a8_self_check_accepts_an_exact_int_mm_and_refuses_a_wrong_one(monkeypatch):
    """The check asks whether torch's int8 GEMM is exact (integer sums), not whether w8a8 is
    close to fp32: it once compared with fp32 at a tolerance the quantization's own error
    exceeds, and refused w8a8 on every CPU that has VNNI."""
    monkeypatch.setattr(quant, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    assert w8a8_missing("cpu") is None
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: real(a, b) + 1)     # off by one
    assert "wrong product" in w8a8_missing("cpu")


def quantized_and_fp32_tokens(tiny, quantization: str):
    """Greedy tokens of 6 prompts on ``quantization``'s engine (its kernel checked by name) and
    on the fp32 engine."""
    prompts = random_prompts(6, seed=3)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    llm = LLM(tiny, engine="paged", block_size=4, quantization=quantization)
    assert llm.engine.runner.net.linear_kernel.name == quantization
    got = [o.token_ids for o in llm.generate(prompts, params, progress=False)]
    want = [o.token_ids for o in LLM(tiny, engine="paged", block_size=4).generate(
        prompts, params, progress=False)]
    return got, want


@pytest.mark.skipif(w8a8_missing() is not None, reason="this CPU cannot run w8a8")
def test_engine_w8a8_produces_tokens(tiny):
    """Where the CPU has int8 units: the engine on w8a8 decodes, mostly the fp32 engine's
    tokens (activations lose more than weights alone: the first token is compared)."""
    got, want = quantized_and_fp32_tokens(tiny, "w8a8")
    assert all(len(t) == 12 for t in got)
    assert sum(a[0] == b[0] for a, b in zip(got, want)) >= 4, (got, want)


@pytest.mark.skipif(w8a8_missing() is None, reason="this CPU runs w8a8")
def test_engine_refuses_w8a8_here(tiny):
    with pytest.raises(RuntimeError, match="w8a8"):
        LLM(tiny, engine="paged", quantization="w8a8")


def test_engine_int8_produces_tokens(tiny):
    """The tiny random model on int8 weights: tokens come, and mostly the fp32 engine's."""
    got, want = quantized_and_fp32_tokens(tiny, "int8")
    assert all(len(t) == 12 for t in got)
    first = sum(a[0] == b[0] for a, b in zip(got, want))
    assert first >= 5, (got, want)


def test_question_14_q1_is_what_int8_stores():
    """14.q1's truth is the definition's arithmetic (a handout stubs quantize_per_channel): it
    equals the bytes the package's own kernel stores for a SmolLM2-sized projection."""
    from minillm.lab import questions
    q, scale = Int8Linear().pack(torch.randn(576, 576))
    assert questions.int8_projection_bytes() == q.nbytes + scale.float().nbytes == 334_080
    assert questions.is_right("14.q1", 334_080) and not questions.is_right("14.q1", 576 * 576 * 4)
