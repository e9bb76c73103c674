"""Exercise 13 — the multi-LoRA gather matmuls: ``sgmv`` and ``bgmv``
(``minillm/engines/r13_lora/kernels.py``).

Graded on values: each kernel is called in the student's process on seeded random batches (fp64,
so that the check is exact) of several shapes — a square one (rank = in = out, where a transposed
or swapped product raises nothing), rank 1, one slot, over 64 rows (``bgmv``'s chunks) — where
the rows mix adapters and rows of the base model, ``y`` already holding the base product and given
as a view of a wider output's columns, as ``LoRALinear`` gives it. Every row's delta must be
``B[s] @ (A[s] @ x[t])`` with its own slot ``s``, added in place; rows without an adapter and the
columns outside the view untouched. Then the engine serves a batch mixing three adapters and the
base model in two slots with each kernel, and every request must equal Hugging Face on its
adapter's merged weights.

The calls run in the student's process (``probe_*``, the ``student`` fixture) and send back the
tensors, judged here.
"""
from __future__ import annotations

import pytest
import torch

from minillm.lab.reference import (assert_greedy_match, merged_references, random_prompts,
                                   serve_loras)

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
PAD = 3              # columns of the layer's output on each side of the view the kernel gets

# (seed, slots, rank, in, out, rows): the shapes the kernels are called with
SHAPES = [(0, 3, 4, 10, 7, 9), (1, 4, 6, 6, 6, 12), (2, 2, 1, 16, 8, 5), (3, 1, 3, 5, 5, 7),
          (4, 5, 8, 12, 20, 150), (5, 3, 5, 5, 5, 70)]


def make_batch(seed: int, slots: int, rank: int, n_in: int, n_out: int, n_rows: int) -> dict:
    """A step's inputs: A [slots, rank, in], B [slots, out, rank], x [rows, in], the output Y
    [rows, PAD + out + PAD] holding a base product, and each row's slot (-1: the base model, at
    least one such row and one row per slot when there are enough rows)."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(slots, rank, n_in, generator=g, dtype=torch.float64)
    B = torch.randn(slots, n_out, rank, generator=g, dtype=torch.float64)
    x = torch.randn(n_rows, n_in, generator=g, dtype=torch.float64)
    Y = torch.randn(n_rows, PAD + n_out + PAD, generator=g, dtype=torch.float64)
    slot = torch.randint(-1, slots, (n_rows,), generator=g)
    slot[:min(n_rows, slots + 1)] = torch.arange(-1, min(n_rows, slots + 1) - 1)
    slot = slot[torch.randperm(n_rows, generator=g)]
    rows = (slot >= 0).nonzero().flatten()
    return {"A": A, "B": B, "x": x, "Y": Y, "slot": slot, "rows": rows, "idx": slot[rows]}


def probe_kernel(kernel: str, shape: tuple) -> dict:
    """``kernel`` on ``make_batch(*shape)``, ``y`` the view ``Y[:, PAD:PAD + out]``: the whole Y
    after the call, and whether what it returned is that y."""
    from minillm.engines.r13_lora import kernels
    b = make_batch(*shape)
    Y = b["Y"].clone()
    y = Y[:, PAD:Y.shape[1] - PAD]
    try:
        if kernel == "sgmv":
            segments = [(int(s), (b["slot"] == s).nonzero().flatten())
                        for s in torch.unique(b["idx"]).tolist()]
            ret = kernels.sgmv(y, b["x"], b["A"], b["B"], segments)
        else:
            ret = kernels.bgmv(y, b["x"], b["A"], b["B"], b["rows"], b["idx"])
    except NotImplementedError:
        raise
    except Exception as e:       # noqa: BLE001 - judged here, with the shapes
        return {"raised": f"{type(e).__name__}: {e}"}
    return {"raised": None, "Y": Y, "returned_y": ret is y}


def judge(kernel: str, shape: tuple, got: dict) -> None:
    seed, slots, rank, n_in, n_out, n_rows = shape
    b = make_batch(*shape)
    where = (f"{kernel} on {n_rows} rows, {slots} slot(s): x [{n_rows}, {n_in}], A [{slots}, "
             f"{rank}, {n_in}], B [{slots}, {n_out}, {rank}]")
    assert got["raised"] is None, (
        f"{where} raised {got['raised']}: row t's delta is B[s] @ (A[s] @ x[t]), the shrink to "
        f"the rank first ([rank, in] @ [in]), then the expand ([out, rank] @ [rank]); for many "
        f"rows at once, (x[rows] @ A[s].T) @ B[s].T")
    Y0, Y, slot = b["Y"], got["Y"], b["slot"].tolist()
    assert torch.equal(Y[:, :PAD], Y0[:, :PAD]) and torch.equal(Y[:, -PAD:], Y0[:, -PAD:]), (
        f"{where}: columns outside y changed: y is a view of the layer's output (its columns of "
        f"one projection of the fused q/k/v or gate/up); write through it, nowhere else")
    y0, y = Y0[:, PAD:-PAD], Y[:, PAD:-PAD]
    if torch.equal(y, y0):
        raise AssertionError(
            f"{where}: y is unchanged after the call"
            f"{'' if got['returned_y'] else ' (what was returned is another tensor)'}: add the "
            "deltas into y in place (y.index_add_, y[rows] += ...): the layer passes a view of "
            "its output and ignores what is returned")
    A, B, x = b["A"], b["B"], b["x"]

    def delta(t: int, s: int) -> torch.Tensor:
        return B[s] @ (A[s] @ x[t])

    for t, s in enumerate(slot):
        if s < 0:
            assert torch.equal(y[t], y0[t]), (
                f"{where}: row {t} runs with the base model (it is not in the rows given), yet "
                "it changed: touch only the rows you are given (rows / each segment's rows)")
            continue
        want = y0[t] + delta(t, s)
        if torch.allclose(y[t], want, rtol=1e-9, atol=1e-9):
            continue
        if torch.allclose(y[t], delta(t, s), rtol=1e-9, atol=1e-9):
            raise AssertionError(f"{where}: row {t} holds its delta alone: y already holds the "
                                 "base model's product W x; add the delta to it (+=), do not "
                                 "overwrite it")
        for other in range(slots):
            if other != s and torch.allclose(y[t], y0[t] + delta(t, other), rtol=1e-9, atol=1e-9):
                raise AssertionError(
                    f"{where}: row {t} runs with slot {s} but got slot {other}'s delta: the "
                    f"indices you are given are already rows of the stacked A and B (0-based: "
                    f"the caller took 1 off the slot), and row t's own index is idx[i] for "
                    f"rows[i] = t")
        if torch.equal(y[t], y0[t]):
            chunks = (" (every row past the first BGMV_CHUNK = 64 too: each chunk, the last one "
                      "included)" if n_rows > 64 else "")
            raise AssertionError(f"{where}: row {t} runs with slot {s} and got no delta{chunks}")
        if n_in == n_out == rank:
            for alt, why in ((A[s].T @ (B[s].T @ x[t]), "A^T (B^T x)"),
                             (B[s].T @ (A[s].T @ x[t]), "B^T (A^T x)"),
                             (A[s] @ (B[s] @ x[t]), "A (B x)")):
                if torch.allclose(y[t], y0[t] + alt, rtol=1e-9, atol=1e-9):
                    raise AssertionError(
                        f"{where}: row {t}'s delta is {why}, not B (A x): A [rank, in] shrinks "
                        "x to the rank first, then B [out, rank] expands it (with a square shape "
                        "a swapped or transposed product raises nothing, and is wrong)")
        err = float((y[t] - want).abs().max())
        raise AssertionError(f"{where}: row {t} (slot {s}) is off by {err:.3g} from y + "
                             f"B[s] @ (A[s] @ x[t])")


CASES = [(kernel, shape) for kernel in ("sgmv", "bgmv") for shape in SHAPES]


@pytest.mark.parametrize("kernel, shape", CASES,
                         ids=[f"{k}-{s[5]}rows-{s[1]}slots-r{s[2]}" for k, s in CASES])
def test_every_row_gets_its_own_adapter_s_delta_in_place(student, kernel, shape):
    judge(kernel, shape, student.run(probe_kernel, kernel, shape))


NAMES = [None, "qv", "mlp", "all", "qv", None, "all", "mlp"]
PROMPTS = random_prompts(len(NAMES), seed=3, hi=24)
MAX_TOKENS = 8
_REFS: list = []


def probe_serve(kernel: str) -> dict:
    from minillm import load_model
    model = load_model("tiny-llama", dtype=torch.float32)
    return serve_loras(model, NAMES, PROMPTS, MAX_TOKENS, max_loras=2, lora_kernel=kernel)


@pytest.mark.parametrize("kernel", ["sgmv", "bgmv"])
def test_a_batch_of_three_adapters_and_the_base_model_equals_their_merged_weights(student,
                                                                                    kernel):
    """Base rows and three adapters (ranks 2, 8, 4; attention, MLP, all seven projections; one
    rsLoRA) in one run with two slots: every request equals Hugging Face on its merged model."""
    got = student.run(probe_serve, kernel)
    assert not any(got["errors"]), f"requests failed: {got['errors']}"
    if not _REFS:
        from minillm import load_model
        _REFS.extend(merged_references(load_model("tiny-llama", dtype=torch.float32), NAMES,
                                       PROMPTS, MAX_TOKENS))
    for i, (name, tokens, ref) in enumerate(zip(NAMES, got["tokens"], _REFS)):
        assert_greedy_match(tokens, ref, label=f"lora_kernel={kernel!r}: request {i} (adapter "
                                              f"{name or 'none: the base model'})")
    assert got["full"], "blocks leaked: the pool is not full again after every request"
