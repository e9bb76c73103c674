"""Exercise 14 — int8 weights: ``quantize_per_channel`` and ``Int8Linear.__call__``
(``minillm/layers/quant.py``).

Graded against a reference written here from the definition (never the package's quant.py): one
fp32 scale per output channel, s = max|W_row| / 127 (1 for an all-zero row), codes round(W / s)
clamped to [-127, 127]. The codes are judged by the round trip: every |W - q s| must be at most
half a step, s / 2 — which, with the scale right, holds exactly for the nearest code (either one
at a .5 tie, where float rounding may go either way). Weights: random ones, a square one with an
outlier, a zero row and a large input column (a scale per column keeps its shape there), exact
.5 steps, rows whose magnitudes span 1e-3..1e3 (a scale per tensor leaves the small rows no
levels), and bf16 weights.

The product is called with codes and scales made here, on each path: ``dequant`` always,
``int8pack`` wherever ``torch.ops.aten._weight_int8pack_mm`` gives the right product in this
process (then it must be the op that computes it); shapes with one row, a square layer whose
row count equals its outputs (a scale applied along the wrong axis raises nothing there), 3-D
activations, bias and residual, float64 activations (q widened to x's dtype). Last, the tiny
random model with ``quantization="int8"`` must give the log-probabilities of Hugging Face's model
with every linear weight replaced here by its quantize-then-widen copy.

Every call of your code happens in your process (``probe_*``, the ``student`` fixture); the codes,
scales, products and log-probabilities it returns are judged here.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
QMAX = 127


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, from the definition: (codes as float64, fp32 scales)."""
    w = w.float()
    codes, scales = torch.empty(w.shape, dtype=torch.float64), torch.empty(w.shape[0])
    for i, row in enumerate(w):
        amax = row.abs().max()
        scale = amax / QMAX if amax > 0 else torch.tensor(1.0)     # fp32 division, as specified
        scales[i] = scale
        codes[i] = (row.double() / scale.double()).round().clamp(-QMAX, QMAX)
    return codes, scales


def weight(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(14)
    if name == "random [24, 64]":
        return torch.randn(24, 64, generator=g)
    if name == "square: outlier, zero row, large column":
        w = torch.randn(16, 16, generator=g) * 0.05
        w[3, 7] = 40.0            # one row's step set by one value
        w[:, 11] *= 30            # a large input column: its own scale would differ per column
        w[5] = 0                  # an all-zero row: scale 1, not 0 (0 / 0 is NaN)
        return w
    if name == "exact .5 steps":
        s = 0.25                  # a power of two: W / s is exact in fp32
        k = torch.arange(-7, 8, dtype=torch.float32)
        rows = [torch.cat([torch.tensor([QMAX * sign]), k + frac]) * s
                for sign in (1, -1) for frac in (0.5, 0.3, 0.7, -0.5)]
        return torch.stack(rows)
    if name == "rows of 1e-3 .. 1e3":
        mags = torch.tensor([1e-3, 1e-1, 1.0, 10.0, 1e3, 0.0])
        return torch.randn(6, 32, generator=g) * mags[:, None]
    if name == "bf16 [8, 24]":
        return torch.randn(8, 24, generator=g).bfloat16()
    raise KeyError(name)


WEIGHTS = ["random [24, 64]", "square: outlier, zero row, large column", "exact .5 steps",
           "rows of 1e-3 .. 1e3", "bf16 [8, 24]"]


def probe_quantize(w: torch.Tensor) -> dict:
    from minillm.layers import quant
    before = w.clone()
    try:
        q, s = quant.quantize_per_channel(w)
    except NotImplementedError:
        raise
    except Exception as e:       # noqa: BLE001 - judged here
        return {"raised": f"{type(e).__name__}: {e}"}
    return {"raised": None, "q": q, "s": s, "w_unchanged": torch.equal(w, before)}


def judge_quantize(name: str, w: torch.Tensor, got: dict) -> None:
    out, n_in = w.shape
    where = f"quantize_per_channel(W) on {name} (W [{out}, {n_in}], {w.dtype})"
    assert got["raised"] is None, f"{where} raised {got['raised']}"
    q, s = got["q"], got["s"]
    assert got["w_unchanged"], f"{where} changed W in place: it is the model's weight; leave it"
    assert isinstance(q, torch.Tensor) and q.dtype == torch.int8 and q.shape == w.shape, (
        f"{where}: q must be a torch.int8 tensor of W's shape [{out}, {n_in}], got "
        f"{getattr(q, 'dtype', type(q).__name__)} {list(getattr(q, 'shape', []))}")
    assert isinstance(s, torch.Tensor) and s.shape == (out,), (
        f"{where}: one scale per output channel (a row of W): shape [{out}], got "
        f"{list(getattr(s, 'shape', []))}"
        + (" — one per input column: take max|W| over dim 1 (a row), not dim 0"
           if getattr(s, "shape", None) == (n_in,) else "")
        + (" — one for the whole tensor" if getattr(s, "numel", lambda: 0)() == 1 else ""))
    assert s.dtype == torch.float32, f"{where}: the scales are float32, got {s.dtype}"
    want_q, want_s = reference_quantize(w)
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    live = amax > 0
    if not torch.allclose(s[live], want_s[live], rtol=1e-6, atol=0):
        why = "s = max|W_row| / 127 for each row, computed in fp32 (W.float())"
        if torch.allclose(s[live], (wf.abs().max() / QMAX).expand(int(live.sum())), rtol=1e-6):
            why = ("every row got the same scale, max|W| / 127 of the whole tensor: one scale "
                   "per output channel (row), so that a row of small weights keeps its levels")
        elif out == n_in and torch.allclose(s, wf.abs().amax(dim=0) / QMAX, rtol=1e-6):
            why = ("these are the scales of the input columns (max over dim 0): one per output "
                   "channel, a row of W (max over dim 1)")
        elif torch.allclose(s[live], amax[live] / (QMAX + 1), rtol=1e-6):
            why = ("s = max|W_row| / 128: the codes are symmetric, -127..127 (so that -q exists "
                   "and the row's largest value is exactly ±127 s): divide by 127")
        raise AssertionError(f"{where}: wrong scales ({why})\ngot  {s}\nwant {want_s}")
    if not live.all():
        zs = s[~live]
        assert torch.equal(zs, torch.ones_like(zs)), (
            f"{where}: an all-zero row gets scale 1 (its codes are 0 anyway), got {zs.tolist()}"
            + (": a scale of 0 divides 0 by 0 (NaN codes)" if (zs == 0).any() or zs.isnan().any()
               else ""))
    # the codes, by the round trip: with the scale right, |W - q s| <= s / 2 holds exactly for
    # the nearest code (and for either one at a .5 tie, where fp32 division may land either side)
    qd, r = q.double(), wf.double() / want_s.double()[:, None]          # r: W in steps
    steps = (r - qd).abs()
    if steps.max() > 0.5 + 1e-4:
        i, j = divmod(int(steps.argmax()), n_in)
        why = "q = round(W / s), clamped to [-127, 127]"
        if ((qd.abs() <= r.abs() + 1e-3) & (qd * r >= 0)).all():      # each code toward zero
            why = ("your codes are W / s truncated toward zero (.to(torch.int8) truncates): "
                   "round to the nearest first")
        raise AssertionError(
            f"{where}: W[{i}, {j}] = {float(wf[i, j]):.6g} is W / s = {float(r[i, j]):.4f} "
            f"steps, stored as {int(q[i, j])}, {float(steps.max()):.3f} steps away: more than "
            f"half a step "
            f"({why}); want {int(want_q[i, j])}")


@pytest.mark.parametrize("name", WEIGHTS)
def test_one_scale_per_output_channel_and_the_nearest_code(student, name):
    w = weight(name)
    judge_quantize(name, w, student.run(probe_quantize, w))


# --- the product ---------------------------------------------------------------------------------
def probe_call(path, x, q, s, bias, residual) -> dict:
    """``Int8Linear(path)(x, (q, s), bias, residual)``, and the aten ops it ran (a dispatch
    mode sees an op however it is reached)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from minillm.layers import quant

    class Ops(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    before = x.clone()
    try:
        with Ops() as ops:
            y = quant.Int8Linear(path)(x, (q, s), bias, residual)
    except NotImplementedError:
        raise
    except Exception as e:       # noqa: BLE001 - judged here
        return {"raised": f"{type(e).__name__}: {e}"}
    return {"raised": None, "y": y, "ops": sorted(ops.seen), "x_unchanged": torch.equal(x, before)}


def int8pack_runs_here() -> bool:
    """Whether the op gives the right product in this process (then the student's path that
    should call it is graded, wherever the student's process has the same torch)."""
    try:
        g = torch.Generator().manual_seed(0)
        x, q = torch.randn(3, 16, generator=g), torch.randint(-127, 128, (5, 16), generator=g)
        s = torch.rand(5, generator=g) + 0.5
        y = torch.ops.aten._weight_int8pack_mm(x, q.to(torch.int8), s)
        return bool(torch.allclose(y, (x.double() @ q.double().T * s.double()).float(),
                                   rtol=1e-4, atol=1e-4))
    except Exception:            # noqa: BLE001 - an op this build lacks: not graded
        return False


# (path, x shape, (out, in), bias, residual, dtype)
PRODUCTS = [("dequant", (32, 32), (32, 32), False, False, torch.float32),      # rows == outputs
            ("dequant", (5, 64), (24, 64), False, False, torch.float32),
            ("dequant", (1, 32), (32, 32), True, False, torch.float32),        # one row
            ("dequant", (2, 3, 64), (24, 64), True, True, torch.float32),      # 3-D, bias, residual
            ("dequant", (4, 40), (12, 40), False, True, torch.float64),        # widen to float64
            (None, (5, 64), (24, 64), True, True, torch.float32),             # int8_path() decides
            ("int8pack", (5, 64), (24, 64), False, False, torch.float32),
            ("int8pack", (32, 32), (32, 32), False, False, torch.float32),
            ("int8pack", (2, 3, 64), (24, 64), True, True, torch.float32)]


def layer(shape_x, shape_w, bias: bool, residual: bool, dtype, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape_w, generator=g) * torch.linspace(0.05, 3, shape_w[0])[:, None]
    codes, s = reference_quantize(w)
    out = shape_w[0]
    return {"w": w.to(dtype), "q": codes.to(torch.int8), "s": s.to(dtype),
            "x": torch.randn(*shape_x, generator=g).to(dtype),
            "bias": torch.randn(out, generator=g).to(dtype) if bias else None,
            "residual": torch.randn(*shape_x[:-1], out, generator=g).to(dtype) if residual
            else None}


def judge_product(case: tuple, L: dict, got: dict) -> None:
    path, shape_x, (out, n_in), bias, residual, dtype = case
    where = (f"Int8Linear({path!r}) on x {list(shape_x)} {dtype}, q [{out}, {n_in}]"
             f"{', bias' if bias else ''}{', residual' if residual else ''}")
    assert got["raised"] is None, (
        f"{where} raised {got['raised']}: y = (x @ q.T) * s (s [out] multiplies y's columns); "
        "on the 'dequant' path widen q to x's dtype (q.to(x.dtype)) before F.linear; on "
        "'int8pack' flatten x to 2-D for the op and give y x's leading dimensions back")
    y = got["y"]
    want_shape = (*shape_x[:-1], out)
    assert isinstance(y, torch.Tensor) and tuple(y.shape) == want_shape, (
        f"{where}: y must have shape {list(want_shape)}, got {list(getattr(y, 'shape', []))}")
    assert y.dtype == dtype, f"{where}: y must be in x's dtype ({dtype}), got {y.dtype}"
    assert got["x_unchanged"], f"{where}: x changed in place: it is the layer's input; leave it"
    x, q, s = L["x"].double(), L["q"].double(), L["s"].double()
    prod = x @ q.T
    b = 0 if L["bias"] is None else L["bias"].double()
    r = 0 if L["residual"] is None else L["residual"].double()
    want = prod * s + b + r
    # fp32: the sum's rounding, relative to the size of its terms; fp64: nearly exact
    size = (x.abs() @ q.abs().T) * s + (0 if L["bias"] is None else b.abs()) + \
        (0 if L["residual"] is None else r.abs())
    tol = size * (1e-5 if dtype == torch.float32 else 1e-12) + 1e-30
    err = (y.double() - want).abs()
    if not (err <= tol).all():
        def near(alt: torch.Tensor) -> bool:
            return bool(((y.double() - alt).abs() <= tol + 1e-6 * alt.abs()).all())

        why = "want residual + ((x @ q.T) * s + bias)"
        if near(prod + b + r):
            why = "the scale is missing: multiply y's columns by s"
        elif out == n_in and near(x @ (q * s[None, :]).T + b + r):
            why = ("s scaled q's columns (the inputs): it belongs to q's rows, the output "
                   "channels, i.e. y's columns")
        elif len(shape_x) == 2 and shape_x[0] == out and near(prod * s[:, None] + b + r):
            why = "s scaled y's rows (the tokens): it belongs to y's columns (the channels)"
        elif bias and near(want - b):
            why = "the bias is missing"
        elif residual and near(want - r):
            why = "the residual is missing: return residual + y"
        raise AssertionError(f"{where}: y is off by up to {float(err.max()):.3g} ({why})")
    # and the quantized product is the layer's product, within what quantization can move it:
    # |x (W - q s)^T| <= |x| @ (s / 2), row by row
    exact = L["x"].double() @ L["w"].double().T + b + r
    bound = x.abs().sum(-1, keepdim=True) * (s / 2) * (1 + 1e-4) + tol
    assert ((y.double() - exact).abs() <= bound).all(), \
        f"{where}: y is further from F.linear(x, W) than quantization allows"
    if path == "int8pack":
        assert any("_weight_int8pack_mm" in op for op in got["ops"]), (
            f"{where}: the 'int8pack' path must compute the product with "
            f"torch.ops.aten._weight_int8pack_mm (the int8 kernel), not by widening q; the ops "
            f"that ran: {got['ops']}")


@pytest.mark.parametrize("case", PRODUCTS, ids=[
    f"{p}-x{'x'.join(map(str, sx))}-w{sw[0]}x{sw[1]}{'-bias' if b else ''}"
    f"{'-residual' if r else ''}-{str(d)[6:]}" for p, sx, sw, b, r, d in PRODUCTS])
def test_the_product_scales_y_s_columns_after_the_sum(student, case):
    path, shape_x, shape_w, bias, residual, dtype = case
    if path == "int8pack" and not int8pack_runs_here():
        pytest.skip("torch.ops.aten._weight_int8pack_mm does not run in this torch build")
    L = layer(shape_x, shape_w, bias, residual, dtype)
    judge_product(case, L, student.run(probe_call, path, L["x"], L["q"], L["s"], L["bias"],
                                       L["residual"]))


# --- the model -----------------------------------------------------------------------------------
def passage() -> list[int]:
    rng = random.Random(14)
    return [rng.randrange(3, 500) for _ in range(48)]


def probe_int8_logprobs() -> torch.Tensor:
    """The passage through the tiny model (fp32) as one prefill, its linear layers on your
    ``Int8Linear`` (what ``quantization="int8"`` runs; where it would pick the C++ decode-row
    kernel, layers/gemv.py, a prefill of the passage goes to your paths anyway): log-probabilities
    [len, vocab]. Torch attention and eager layer ops: nothing to compile in the student's
    process (a fresh home: a C++ extension would be built there from scratch, minutes)."""
    from minillm.core.runner import ModelRunner, pad_tables
    from minillm.layers.attention.reference import AttentionMetadata, TorchAttention
    from minillm.layers.fused import EagerOps
    from minillm.layers.quant import Int8Linear
    from minillm.lab.reference import tiny_model

    model, ids, bs = tiny_model(), passage(), 16
    n, nblocks = len(ids), -(-len(ids) // bs)
    kernel = Int8Linear()
    runner = ModelRunner(model, nblocks, bs, TorchAttention(), linear_kernel=kernel,
                         ops=EagerOps())
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), num_decode=0, decode_block_tables=pad_tables([], "cpu"),
        decode_context_lens=torch.empty(0, dtype=torch.int32),
        prefill_block_tables=pad_tables([list(range(nblocks))], "cpu"),
        prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
        prefill_q_lens=[n], prefill_ctx_lens=[n])
    with torch.inference_mode():      # inside: a decorated probe is not found by its name
        hidden = runner.forward(torch.tensor(ids), torch.arange(n), meta)
        return runner.net.logits(runner.net.final_hidden(hidden)).log_softmax(-1)


@torch.inference_mode()
def hf_logprobs(quantized: bool) -> torch.Tensor:
    """Hugging Face's forward of the tiny model over the passage, with every linear weight
    (lm_head too) replaced by its quantize-then-widen copy (``quantized``), in fp64."""
    from minillm.lab.reference import tiny_model
    hf = copy.deepcopy(tiny_model().hf_model).double()
    if quantized:
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear):
                codes, s = reference_quantize(module.weight.detach().float())
                module.weight = torch.nn.Parameter(codes * s.double()[:, None])   # unties lm_head
    return hf(torch.tensor([passage()])).logits[0].log_softmax(-1)


def test_the_tiny_model_on_int8_weights_is_its_quantized_copy(student):
    """The package's code is 3.2e-5 from the quantized copy (fp32 sums against fp64 ones; the
    bound is 1e-3); the unquantized weights are 1.1 away, a scale per tensor 1.9."""
    got = student.run(probe_int8_logprobs)
    want = hf_logprobs(quantized=True)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, \
        f"log-probabilities [{want.shape[0]}, vocab] per position, got {getattr(got, 'shape', got)}"
    assert torch.isfinite(got).all(), "NaN or inf log-probabilities"
    err = float((got.double() - want).abs().max())
    if err > 1e-3:
        plain = float((got.double() - hf_logprobs(quantized=False)).abs().max())
        raise AssertionError(
            f"quantization='int8' on the tiny model: log-probabilities up to {err:.3g} from the "
            f"model whose linear weights are quantized per output channel (and {plain:.3g} from "
            "its fp32 weights): the layers compute another product than (x @ q.T) * s (+ bias, "
            "+ residual)")
