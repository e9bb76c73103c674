"""The fused layer ops (layers/fused.py, csrc/fused_ops.cpp) against the eager reference. For a
16-bit model: the same numbers computed in fp32 and rounded once, so within one 16-bit rounding of
eager torch (which rounds after every op), and exactly what fp32 arithmetic on the inputs gives.
For an fp32 model: within a few units of fp32's last place of the exact (float64) result."""
from __future__ import annotations

import pytest
import torch

from minillm.layers import fused
from minillm.layers.fused import EagerOps, FusedOps, layer_ops, rope_heads

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops() -> FusedOps:
    chosen = layer_ops(torch.bfloat16, torch.device("cpu"))
    if not isinstance(chosen, FusedOps):
        pytest.skip(f"the fused ops cannot be built here: {fused._state.get('error')}")
    return chosen


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error in units of the 16-bit type's rounding at the reference's magnitude (at
    least the smallest normal number's: below it, fp16 keeps fewer digits)."""
    info = torch.finfo(got.dtype)
    unit = want.float().abs().clamp(min=info.tiny) * info.eps
    return ((got.float() - want.float()).abs() / unit).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (130, 960)])
def test_rms_norm_rounds_where_hf_rounds(ops, dtype, rows, hidden):
    torch.manual_seed(rows)
    x, w = (torch.randn(rows, hidden) * 3).to(dtype), (torch.rand(hidden) + 0.5).to(dtype)
    want = (torch.nn.functional.rms_norm(x.float(), (hidden,), eps=1e-5).to(dtype).float()
            * w.float()).to(dtype)                        # HF: narrow, then times the weight
    got = ops.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    # the intermediate rounding may differ by one unit (another order of the sum of squares),
    # carried through the weight, plus the final rounding
    assert ulps(got, want) <= 2.0
    assert ulps(got, EagerOps.rms_norm(x, w, 1e-5)) <= 2.0
    assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 1, 128), (2, 2, 16)])
def test_rope_is_one_rounding_of_the_rotation(ops, dtype, heads, kv_heads, d):
    torch.manual_seed(heads * d)
    rows = 33
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).to(dtype)
    angle = torch.rand(rows, d // 2).repeat(1, 2) * 6
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    q, k = ops.rope(qkv, cos, sin, heads, kv_heads)
    exact = rope_heads(qkv.float()[:, :(heads + kv_heads) * d].view(rows, -1, d), cos.float(),
                       sin.float())
    assert q.is_contiguous() and k.is_contiguous()
    assert q.shape == (rows, heads, d) and k.shape == (rows, kv_heads, d)
    assert torch.equal(q, exact[:, :heads].to(dtype)) or ulps(q, exact[:, :heads]) <= 0.51
    assert ulps(k, exact[:, heads:]) <= 0.51 or torch.equal(k, exact[:, heads:].to(dtype))
    eq, ek = EagerOps.rope(qkv, cos, sin, heads, kv_heads)
    scale = qkv.float().abs().max() * torch.finfo(dtype).eps * 4   # eager rounds 3 times
    assert (q.float() - eq.float()).abs().max() <= scale
    assert (k.float() - ek.float()).abs().max() <= scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_one_rounding(ops, dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(65, 2 * 1536) * 4).to(dtype)
    got = ops.silu_mul(gate_up)
    g, u = gate_up.float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(g) * u
    assert got.shape == (65, 1536) and got.dtype == dtype
    assert ulps(got, want) <= 0.51 + 1e-3


@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (130, 960), (3, 40)])
def test_fp32_ops_are_the_exact_result_to_a_few_units(ops, rows, hidden):
    """An fp32 model's ops, against float64: what the additions' order can change and no more
    (eager torch is held to the same bound). ``hidden`` 40 takes the scalar loops."""
    torch.manual_seed(rows)
    x, w = torch.randn(rows, hidden) * 3, torch.rand(hidden) + 0.5
    x64 = x.double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    eps = torch.finfo(torch.float32).eps
    for got in (ops.rms_norm(x, w, 1e-5), EagerOps.rms_norm(x, w, 1e-5)):
        assert got.dtype == torch.float32
        assert ((got.double() - want).abs() / want.abs()).max() <= 4 * eps

    heads, kv_heads, d = 3, 1, 64 if hidden % 16 == 0 else 8
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    angle = torch.rand(rows, d // 2).repeat(1, 2) * 6
    q, k = ops.rope(qkv, angle.cos(), angle.sin(), heads, kv_heads)
    exact = rope_heads(qkv.double()[:, :(heads + kv_heads) * d].view(rows, -1, d),
                       angle.cos().double(), angle.sin().double())
    scale = qkv.abs().max() * eps * 2            # the rotation of a pair may cancel: absolute
    assert (q.double() - exact[:, :heads]).abs().max() <= scale
    assert (k.double() - exact[:, heads:]).abs().max() <= scale

    gate_up = torch.randn(rows, 2 * hidden) * 4
    g, u = gate_up.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(g) * u
    got = ops.silu_mul(gate_up)
    assert ((got.double() - want).abs() / want.abs().clamp(min=1e-30)).max() <= 8 * eps


def test_fp32_and_16_bit_cpu_models_get_the_fused_ops_other_devices_the_eager(ops):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert type(layer_ops(dtype, torch.device("cpu"))) is FusedOps
    assert type(layer_ops(torch.bfloat16, torch.device("meta"))) is EagerOps
    assert type(layer_ops(torch.float64, torch.device("cpu"))) is EagerOps
    with pytest.raises(ValueError, match="layer_ops='fused' computes fp32/bf16/fp16 on the CPU, "
                                         "not torch.float64"):
        layer_ops(torch.float64, torch.device("cpu"), "fused")


def test_wrong_inputs_are_errors_naming_them(ops):
    with pytest.raises(RuntimeError, match="x must be a bf16, fp16 or fp32 CPU tensor, got Double"):
        ops.module.rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match=r"rope: qkv \[T, \(H \+ 2 KVH\) D\]"):
        ops.module.rope(torch.randn(2, 40).bfloat16(), torch.randn(2, 8).bfloat16(),
                        torch.randn(2, 8).bfloat16(), 2, 1)


def test_fused_ops_travel_to_worker_processes_by_pickle(ops):
    """Pipeline and tensor-parallel workers receive the model pickled: the ops re-load there."""
    import pickle
    again = pickle.loads(pickle.dumps(ops))
    assert isinstance(again, FusedOps) and again.module is ops.module    # same process: cached


def test_the_engine_option_chooses_the_ops_and_refuses_what_cannot_run(tiny):
    """``layer_ops=`` (ModelConfig): a bf16 model runs either, and their tokens agree but for
    near-ties (one 16-bit rounding apart); an fp32 model's agree exactly; an unknown name is an
    error naming it."""
    from minillm import LLM, SamplingParams
    from minillm.models import load_model

    model = load_model("tiny-llama", dtype=torch.bfloat16, device="cpu")   # the CPU's fused ops
    prompts = [[5, 6, 7, 8], [9, 10, 11], [3] * 12]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outs = {}
    for ops in ("fused", "eager"):
        llm = LLM(model, engine="paged", layer_ops=ops, num_blocks=32)
        assert llm.engine.describe()["layer_ops"] == ops
        outs[ops] = [o.token_ids for o in llm.generate(prompts, params)]
    assert sum(a == b for a, b in zip(outs["fused"], outs["eager"])) >= 2
    cpu = load_model("tiny-llama", dtype=torch.float32, device="cpu")   # tiny is CUDA's on a GPU
    fp32 = [[o.token_ids for o in LLM(cpu, engine="paged", layer_ops=ops, num_blocks=32)
             .generate(prompts, params)] for ops in ("fused", "eager")]
    assert fp32[0] == fp32[1]
    with pytest.raises(ValueError, match="unknown layer_ops 'fast'"):
        LLM(tiny, engine="paged", layer_ops="fast", num_blocks=32)
