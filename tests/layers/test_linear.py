"""The linear-layer kernels (layers/linear.py): oneDNN on reordered weights computes what
``F.linear`` does, survives pickling (pipeline workers), and where it cannot run the engine falls
back to torch with one warning and the same tokens."""
from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import random_prompts
from minillm import LLM, SamplingParams
from minillm.layers import linear as linear_mod
from minillm.layers.config import ModelConfig
from minillm.layers.linear import Linear, OneDNNLinear, TorchLinear, get_linear_kernel, onednn_works

needs_onednn = pytest.mark.skipif(not onednn_works(), reason="no oneDNN in this torch build")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 7, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_onednn_equals_f_linear(rows, bias, residual):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 48, generator=g)[:, 3:43]          # a non-contiguous view
    r = torch.randn(rows, 96, generator=g) if residual else None
    lin = Linear(w, b, OneDNNLinear())
    want = F.linear(x, w, b) + (r if residual else 0)
    got = lin(x, residual=r)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert lin.packed.is_mkldnn and not lin.weight.is_mkldnn   # the plain weight is kept


@pytest.mark.skipif(not onednn_works(torch.bfloat16), reason="no oneDNN bf16 in this build")
@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("residual", [False, True])
def test_onednn_bf16_equals_fp32_product_of_the_same_numbers(rows, residual):
    """In bf16 oneDNN multiplies the bf16 numbers exactly and accumulates in fp32: its result is
    the fp32 product of the same (bf16-rounded) inputs, rounded once to bf16."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 576, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    r = torch.randn(rows, 96, generator=g).bfloat16() if residual else None
    got = Linear(w, b, OneDNNLinear())(x, residual=r)
    want = F.linear(x.float(), w.float(), b.float()) + (r.float() if residual else 0)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding of the result (2^-8 relative), plus the residual's own rounding
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max())


@pytest.mark.parametrize("kernel", [TorchLinear(), pytest.param(OneDNNLinear(),
                                                                 marks=needs_onednn)])
def test_linear_pickles_and_repacks(kernel):
    """A pipeline worker receives the model by pickle: each Linear is rebuilt, packed again."""
    w, b, x = torch.randn(16, 8), torch.randn(16), torch.randn(3, 8)
    lin = Linear(w, b, kernel)
    copy = pickle.loads(pickle.dumps(lin))
    assert copy.kernel.name == kernel.name and copy.packed is not lin.packed
    torch.testing.assert_close(copy(x), lin(x), rtol=0, atol=0)
    assert copy.out_features == 16


def test_kernel_choice():
    cpu = torch.device("cpu")
    assert get_linear_kernel("torch", cpu, torch.float32).name == "torch"
    assert get_linear_kernel(None, cpu, torch.float64).name == "torch"  # oneDNN: fp32 and bf16
    assert get_linear_kernel(None, cpu, torch.float16).name == "torch"
    for dtype in (torch.float32, torch.bfloat16):
        assert get_linear_kernel(None, cpu, dtype).name == \
            ("onednn" if onednn_works(dtype) else "torch")
    with pytest.warns(RuntimeWarning, match="linear_backend='onednn' cannot run here"):
        assert get_linear_kernel("onednn", cpu, torch.float64).name == "torch"
    with pytest.raises(ValueError, match="unknown linear_backend 'mkl'"):
        get_linear_kernel("mkl", cpu, torch.float32)
    with pytest.raises(ValueError, match="linear_backend 'blas'"):
        ModelConfig(linear_backend="blas")


def test_engine_falls_back_without_onednn(tiny, monkeypatch):
    """A torch build whose oneDNN fails the probe: the default engine runs F.linear silently,
    ``linear_backend='onednn'`` warns once, and both give the tokens the onednn engine gives."""
    prompts = random_prompts(6, seed=5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fast = LLM(tiny, engine="paged", block_size=4)
    want = [o.token_ids for o in fast.generate(prompts, params)]
    monkeypatch.setattr(linear_mod, "onednn_works", lambda dtype=torch.float32: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        default = LLM(tiny, engine="paged", block_size=4)
        asked = LLM(tiny, engine="paged", block_size=4, linear_backend="onednn")
    ours = [w for w in caught if "linear_backend" in str(w.message)]
    assert len(ours) == 1 and "using torch's F.linear" in str(ours[0].message)
    for llm in (default, asked):
        assert llm.engine.runner.net.linear_kernel.name == "torch"
        assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_profile_floor_counts_every_linear_layer(tiny, capsys):
    """``make profile``'s floor runs every matrix product of the model: its FLOPs are 2 x rows x
    the weights of all the HF model's nn.Linear modules (lm_head included), and a run on the
    tiny model prints one row per row count with its ratio to that floor."""
    from minillm.bench import profile_step
    from minillm.core.model import PagedLlama

    net = PagedLlama(tiny.hf_model)
    weights = sum(m.weight.numel() for m in tiny.hf_model.modules()
                  if isinstance(m, torch.nn.Linear))
    _, flops = profile_step.linear_chain(net, rows=5)
    assert flops == 2 * 5 * weights
    assert profile_step.main(["--model", "tiny-llama", "--rows", "1,3", "--steps", "2",
                              "--context", "9", "--backend", "torch", "--dtype",
                              "float32,bfloat16",
                              "--linear", "torch,onednn" if onednn_works() else "torch"]) == 0
    out = capsys.readouterr().out
    assert "float32 matmul peak" in out and "bfloat16 matmul peak" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["3"])]
    per_dtype = 2 if onednn_works() else 1
    assert [r[0] for r in rows] == ["1"] * 2 * per_dtype + ["3"] * 2 * per_dtype
    assert [r[1] for r in rows[:2 * per_dtype]] == ["float32"] * per_dtype + \
        ["bfloat16"] * per_dtype                        # the model's dtype column
    assert all(r[5] == "auto" for r in rows)            # the KV cache dtype column
    assert all(float(r[9]) > 0 for r in rows)          # the ratio column
    # the layer-ops column: both dtypes take the fused ones where they build, all rows alike
    assert len({r[3] for r in rows}) == 1 and rows[0][3] in ("fused", "eager")


def test_profile_chains_compares_the_kernels_named(tiny, capsys):
    """``profile_step --chains torch,gemv``: one line per row count, every named kernel on it
    with its time, and the first kernel's ratio to itself 1.00x."""
    from minillm.bench import profile_step
    assert profile_step.main(["--model", "tiny-llama", "--rows", "2,9", "--steps", "2",
                              "--dtype", "float32", "--chains", "torch,gemv"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " rows " in line]
    assert [line.split()[0] for line in lines] == ["2", "9"]
    assert all("torch " in line and "gemv " in line and "(" in line for line in lines)
    assert all(line.split("torch ")[1].split("x)")[0].endswith("1.00") for line in lines)


def test_profile_busy_cores_are_stopped():
    """``make profile --busy N``: N spinning processes while measuring, none left afterwards,
    also when the measurement fails."""
    from minillm.bench.profile_step import busy_cores

    with pytest.raises(RuntimeError, match="measuring failed"):
        with busy_cores(2) as hogs:
            assert len(hogs) == 2 and all(h.poll() is None for h in hogs)
            raise RuntimeError("measuring failed")
    assert all(h.poll() is not None for h in hogs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_freed_activations_stay_in_the_process_for_the_next_step():
    """After ``keep_freed_memory`` (called by every CPU ModelRunner) a step-sized temporary
    (12 MiB) comes from malloc's heap, not a mapping of its own, and once freed it stays in the
    process for the next step to reuse: no fresh pages to fault in. glibc's default maps such a
    block and unmaps it when freed (see runner.py). Read from glibc's own books (``mallinfo2``),
    not from page-fault counts, which depend on what else the machine is doing."""
    code = textwrap.dedent("""
        import ctypes, sys, torch
        from minillm.core.runner import keep_freed_memory
        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        if sys.argv[1] == "keep":
            assert keep_freed_memory()
        before = libc.mallinfo2().hblkhd
        a = torch.ones(1024, 3072)                  # 12 MiB, a step's temporary
        mapped = libc.mallinfo2().hblkhd - before   # bytes in mappings of their own
        del a
        print(mapped, libc.mallinfo2().fordblks)    # free bytes kept in the heap
        """)
    import ctypes
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    got = {}
    for mode in ("keep", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                             check=True).stdout.split()
        got[mode] = tuple(map(int, out))
    mib12 = 1024 * 3072 * 4
    assert got["keep"][0] < mib12 and got["keep"][1] >= mib12, got
    assert got["default"][0] >= mib12 and got["default"][1] < mib12, got
