"""Rung 13's BGMV as a Triton kernel (``lora_kernel="triton"``), under Triton's CPU interpreter
where there is no GPU: each row's delta equals ``kernels.delta_reference`` (fp32, bf16), rows of
the base model and rows not asked for are untouched, and an engine using it gives the tokens of
``sgmv``'s."""
from __future__ import annotations

import os

import torch  # does not import triton

if not torch.cuda.is_available():                 # before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from minillm import LLM, LoRARequest, SamplingParams  # noqa: E402
from minillm.engines.r13_lora.kernels import delta_reference  # noqa: E402
from minillm.engines.r13_lora.peft_files import save_random_adapter  # noqa: E402
from minillm.engines.r13_lora.triton_bgmv import triton_bgmv  # noqa: E402


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rank,k,n", [(8, 64, 96), (3, 100, 70), (16, 130, 64)])
def test_each_row_gets_its_slot_s_delta(dtype, tol, rank, k, n):
    g = torch.Generator().manual_seed(rank * k + n)
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # native kernels on a GPU
    A = torch.randn(3, rank, k, generator=g).to(dev, dtype)
    B = torch.randn(3, n, rank, generator=g).to(dev, dtype)
    x = torch.randn(7, k, generator=g).to(dev, dtype)
    y0 = torch.randn(7, n, generator=g).to(dev, dtype)
    rows, idx = torch.tensor([0, 2, 3, 6], device=dev), torch.tensor([2, 0, 2, 1], device=dev)
    y = triton_bgmv(y0.clone(), x, A, B, rows, idx)
    want = y0.float().clone()
    want[rows] += delta_reference(x[rows].float(), A.float(), B.float(), idx)
    scale = want.abs().max()
    assert (y.float() - want).abs().max() <= tol * scale
    others = torch.tensor([1, 4, 5], device=dev)
    assert torch.equal(y[others], y0[others]), "rows without an adapter changed"


def test_mismatched_shapes_are_named():
    A, B = torch.zeros(2, 4, 8), torch.zeros(2, 6, 4)
    with pytest.raises(ValueError, match="do not fit together"):
        triton_bgmv(torch.zeros(3, 5), torch.zeros(3, 8), A, B, torch.tensor([0]), torch.tensor([1]))


def test_engine_with_the_triton_kernel_equals_sgmv(tiny, tmp_path):
    loras = [LoRARequest(f"a{i}", str(save_random_adapter(
        tmp_path / f"a{i}", tiny.hf_model, r=4 + 2 * i, lora_alpha=8, use_rslora=False, seed=i,
        targets=("q_proj", "v_proj", "down_proj") if i else ("o_proj", "gate_proj", "up_proj"))))
        for i in range(2)]
    prompts, params = ["The first", "A second prompt", "and a third"], SamplingParams(max_tokens=6)
    which = [loras[0], None, loras[1]]
    outs = {}
    for kernel in ("sgmv", "triton"):
        llm = LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=8, lora_kernel=kernel)
        outs[kernel] = [o.token_ids for o in llm.generate(prompts, params, lora_request=which)]
    assert outs["triton"] == outs["sgmv"]
