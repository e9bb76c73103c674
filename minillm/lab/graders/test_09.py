"""Exercise 09 — a quantized KV cache: ``quantize`` and ``dequantize`` (``minillm/layers/kv_quant.py``),
and the pool that uses them: ``QuantizedPool.index_copy_`` (quantize on write) and
``QuantizedPool.index_select`` / ``__getitem__`` (widen only the rows that are read).

Graded against a reference written here from the definition (one scale per row: max|x| / qmax, 1
for an all-zero row; int8 rounds to nearest, ties to even), then through the torch attention of
rung 3 reading the student's pool, then end to end: the engine with an int8 cache must stay close
to the full-precision cache (KL of its next-token distributions), keep its scales with its blocks
under copy-on-write, prefix hits and preemption, and give the pool back full.

Every call of your code happens in your process (``probe_*``, the ``student`` fixture): the rows,
scales, pools and log-probabilities it returns are judged here, against the definition and the
package's own code.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.layers.attention.reference import TorchAttention
from minillm.layers.kv_quant import FORMATS, QuantizedPool, dequantize, quantize
from minillm.lab.reference import pressure_runs

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)

INT8, FP8 = FORMATS["int8"], FORMATS["fp8"]
values = st.floats(-300, 300, allow_nan=False, width=32)


def reference_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, from the definition."""
    flat = x.reshape(-1, x.shape[-1]).double()
    codes, scales = torch.empty(flat.shape, dtype=torch.int8), torch.empty(len(flat))
    for i, row in enumerate(flat):
        amax = float(row.abs().max())
        scale = torch.tensor(amax / 127 if amax > 0 else 1.0, dtype=torch.float32)
        scales[i] = scale
        codes[i] = torch.round(row / scale.double()).clamp(-127, 127).to(torch.int8)
    return codes.view(x.shape), scales.view(x.shape[:-1])


def probe_quantize(x: torch.Tensor, name: str) -> tuple:
    q, scale = quantize(x, FORMATS[name])
    return (q.float() if q.dtype == torch.float8_e4m3fn else q), str(q.dtype), scale


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(values, min_size=8, max_size=8), min_size=2, max_size=12),
       heads=st.sampled_from([2, 3]), zero_row=st.booleans())
def test_int8_one_scale_per_row_round_to_nearest(student, rows, heads, zero_row):
    """Rows of 2 or 3 KV heads: one scale per token *and* KV head, never one per token."""
    rows = rows[:len(rows) // heads * heads]
    x = torch.tensor(rows).view(len(rows) // heads, heads, 8)
    if zero_row:
        x[0, 0] = 0
    q, dtype, scale = student.run(probe_quantize, x, "int8")
    assert dtype == "torch.int8", f"int8 rows must be stored as torch.int8, got {dtype}"
    assert isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 \
        and scale.shape == x.shape[:-1], \
        "one fp32 scale per row (per token and KV head): shape x.shape[:-1]"
    want_q, want_scale = reference_int8(x)
    assert torch.allclose(scale, want_scale, rtol=1e-6), \
        f"scale must be max|x| / 127 per row (1 for an all-zero row): got {scale}, want {want_scale}"
    off = (q.int() - want_q.int()).abs()
    # a code may differ by one only where x / scale sits on a .5 tie (float rounding either way)
    tie = ((x / want_scale[..., None]).abs() % 1 - 0.5).abs() < 1e-4
    assert q.shape == x.shape and ((off == 0) | ((off == 1) & tie)).all(), \
        f"codes must be round(x / scale) clamped to [-127, 127]:\ngot  {q}\nwant {want_q}"


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(values, min_size=8, max_size=8), min_size=2, max_size=8))
def test_fp8_scales_to_448_and_stays_within_e4m3_rounding(student, rows):
    rows = rows[:len(rows) // 2 * 2]
    x = torch.tensor(rows).view(len(rows) // 2, 2, 8)
    q, dtype, scale = student.run(probe_quantize, x, "fp8")
    assert dtype == "torch.float8_e4m3fn", f"fp8 rows are stored as float8_e4m3fn, got {dtype}"
    amax = x.abs().amax(-1)
    want = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert isinstance(scale, torch.Tensor) and scale.shape == want.shape \
        and torch.allclose(scale, want, rtol=1e-6), "fp8: scale = max|x| / 448 per row"
    back = q.float() * scale[..., None]
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scale[..., None] * 2 ** -10 + 1e-30).all()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_formats_are_a_cast_with_no_scale(student, name):
    x = torch.randn(4, 2, 8) * 50
    q, dtype, scale = student.run(probe_quantize, x, name)
    assert scale is None, "a 16-bit format keeps no scale (it is a cast)"
    want = x.to(FORMATS[name].storage)
    assert dtype == str(want.dtype) and torch.equal(q, want)


def probe_dequantize(q, scale, dtype):
    return dequantize(q, scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dequantize_multiplies_each_row_by_its_scale(student, dtype):
    q = torch.randint(-127, 128, (5, 3, 8), dtype=torch.int8)
    scale = torch.rand(5, 3) * 4
    got = student.run(probe_dequantize, q, scale, dtype)
    assert got.dtype == dtype, f"dequantize must return rows in the dtype asked for ({dtype})"
    assert torch.allclose(got.double(), q.double() * scale.double()[..., None], rtol=1e-6)
    half = torch.randn(5, 3, 8).half()
    assert torch.equal(student.run(probe_dequantize, half, None, dtype), half.to(dtype)), \
        "no scale: only a cast"


def raw(pool) -> tuple:
    """A pool's stored rows (as float: fp8 does not travel) and scales, as they are."""
    return pool.data.float().clone(), None if pool.scale is None else pool.scale.clone()


def probe_pool(shape: tuple, name: str, slots: torch.Tensor, rows: torch.Tensor,
               ids: torch.Tensor) -> dict:
    pool = QuantizedPool.zeros(shape, FORMATS[name], torch.float32, torch.device("cpu"))
    before = raw(pool)
    pool.view(-1, *shape[2:]).index_copy_(0, slots, rows)
    return {"before": before, "after": raw(pool),
            "selected": pool.view(-1, *shape[2:]).index_select(0, slots), "blocks": pool[ids]}


@settings(max_examples=30, deadline=None)
@given(block_size=st.sampled_from([1, 4, 8]), n=st.integers(1, 12), seed=st.integers(0, 999),
       name=st.sampled_from(["int8", "fp8", "bfloat16"]))
def test_the_pool_writes_rows_where_told_and_reads_them_back_widened(student, block_size, n,
                                                                     seed, name):
    gen = torch.Generator().manual_seed(seed)
    blocks = 4 * -(-n // block_size) + 1
    slots = torch.tensor(random.Random(seed).sample(range(blocks * block_size), n))
    rows = torch.randn(n, 2, 8, generator=gen) * 10
    ids = torch.tensor([blocks - 1, 0])
    got = student.run(probe_pool, (blocks, block_size, 2, 8), name, slots, rows, ids)
    want_q, want_scale = quantize(rows, FORMATS[name])          # the reference's, here
    (data0, scale0), (data, scale) = got["before"], got["after"]
    flat = data.view(-1, 2, 8)
    assert torch.equal(flat[slots], want_q.float()), "row i goes to flat slot slots[i]"
    if want_scale is not None:
        assert scale is not None and torch.equal(scale.view(-1, 2)[slots], want_scale), \
            "each row's scale goes to the scale pool at the same slot"
    others = torch.ones(blocks * block_size, dtype=torch.bool)
    others[slots] = False
    for t, old in ((data, data0), (scale, scale0)):
        if t is not None:
            assert torch.equal(t.reshape(blocks * block_size, -1)[others],
                               old.reshape(blocks * block_size, -1)[others]), \
                "slots not written must be left as they were"
    assert got["selected"].dtype == torch.float32, "reads return rows in the pool's dtype"
    assert torch.allclose(got["selected"], dequantize(want_q, want_scale, torch.float32))
    stored = data.to(FORMATS[name].storage)
    assert torch.allclose(got["blocks"], dequantize(stored[ids], None if scale is None
                                                    else scale[ids], torch.float32)), \
        "pool[block_ids]: those blocks, widened"


def probe_rung_3(k, v, q, table, lens, slots) -> tuple:
    pools = [QuantizedPool.zeros((16, 4, 2, 8), INT8, torch.float32, torch.device("cpu"))
             for _ in range(2)]
    attn = TorchAttention()
    attn.write_kv(k, v, pools[0], pools[1], slots)
    out = attn.decode(q, pools[0], pools[1], table, lens, 0.3)
    return out, [(p.data.clone(), p.scale.clone()) for p in pools]


def test_rung_3_attention_reads_your_pool_as_dequantize_then_attend(student):
    torch.manual_seed(3)
    bs, lens = 4, [1, 4, 9, 13]
    table = torch.randperm(16).to(torch.int32).view(4, 4)
    slots = torch.cat([table[b].long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
                       for b, n in enumerate(lens)])
    k, v = torch.randn(len(slots), 2, 8), torch.randn(len(slots), 2, 8)
    q = torch.randn(4, 6, 8)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got, pools = student.run(probe_rung_3, k, v, q, table, lens_t, slots)
    dense = [dequantize(d, s, torch.float32) for d, s in pools]      # the reference's, here
    want = TorchAttention().decode(q, dense[0], dense[1], table, lens_t, 0.3)
    assert torch.allclose(got, want, atol=1e-6)


def passage() -> list[int]:
    rng = random.Random(9)
    return [rng.randrange(3, 500) for _ in range(70)]


def probe_int8_logprobs() -> torch.Tensor:
    from minillm import load_model
    from minillm.bench.kv_accuracy import passage_logprobs
    model = load_model("tiny-llama", dtype=torch.float64)
    return passage_logprobs(model, passage(), "int8", TorchAttention())


def test_the_engine_on_an_int8_cache_stays_close_to_full_precision(student):
    """Next-token distributions over 70 tokens on the tiny model, int8 cache vs full precision:
    the package's code gives a mean KL of 1.8e-3 (fp64); a lost scale or truncated codes give
    far more."""
    from minillm import load_model
    from minillm.bench.kv_accuracy import kl_and_perplexity, passage_logprobs

    model, ids = load_model("tiny-llama", dtype=torch.float64), passage()
    ref = passage_logprobs(model, ids, "auto", TorchAttention())
    got = student.run(probe_int8_logprobs)
    assert isinstance(got, torch.Tensor) and got.shape == ref.shape, "log-probabilities per position"
    kl, _ = kl_and_perplexity(ref, got.to(ref.dtype), ids)
    assert kl < 5e-3, f"mean KL {kl:.2e} from the full-precision cache: quantization too coarse"


def probe_pressure() -> tuple:
    return pressure_runs("int8")


def test_scales_travel_with_their_blocks_under_pressure(student):
    """A tight pool (forks, copy-on-write, prefix hits, preemption) must give exactly what a roomy
    pool gives, on the student's pool; and the roomy pool what the package's gives."""
    roomy, tight, preemptions, leaks = student.run(probe_pressure)
    assert preemptions > 0 and not leaks, f"the tight pool must preempt ({preemptions}) and end full"
    assert tight == roomy, ("QuantizedPool.index_copy_ and index_select: a scale written or read "
                            "at another slot than its row changes the tokens under pressure")
    assert roomy == pressure_runs("int8", tight=False)[0], "the tokens differ from the package's"
