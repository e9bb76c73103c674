"""Triton is optional: requirements.txt installs it only on Linux (the only wheels there are).

Everything but rung 4 must import and run without it, and asking for rung 4's attention backend
without it must say what to do instead of failing deep inside an import. Triton is hidden here
(``sys.modules["triton"] = None`` makes ``import triton`` raise ImportError), so these tests run
the same whether or not it is installed.
"""
from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

import minillm.layers.attention.triton as s4
from minillm.engines import get_attention_backend

CPU = torch.device("cpu")

# Run in a fresh interpreter where triton cannot be imported: every module but rung 4's kernels
# imports, and the paged engine generates with the torch backend (the CPU default).
WITHOUT_TRITON = r"""
import importlib, pkgutil, sys
sys.modules["triton"] = None
import minillm
skip = ("minillm.layers.attention.triton.backend", "minillm.layers.attention.triton.kernels",
        "minillm.engines.r13_lora.triton_bgmv")
names = [m.name for m in pkgutil.walk_packages(minillm.__path__, "minillm.") if m.name not in skip]
for name in names:
    importlib.import_module(name)
from minillm import LLM, SamplingParams
llm = LLM(model="tiny-llama", engine="paged", device="cpu")
out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
assert [len(o.token_ids) for o in out] == [4, 4] and not any(o.error for o in out), out
assert llm.engine.backend.name in ("torch", "cpp"), llm.engine.backend   # never triton on CPU
print("ok", len(names), "modules")
"""


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)


def test_triton_backend_without_triton_says_what_to_do(no_triton, monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(s4.platform, "machine", lambda: "x86_64")
    assert not s4.triton_available()
    with pytest.raises(s4.TritonUnavailableError) as e:
        get_attention_backend("triton", CPU)
    msg = str(e.value)
    assert isinstance(e.value, ImportError)
    assert "needs the triton package" in msg and "pip install triton" in msg
    assert "attention_backend='torch'" in msg
    with pytest.raises(ImportError, match="pip install triton"):
        from minillm.layers.attention.triton import TritonAttention  # noqa: F401
    assert type(get_attention_backend("torch", CPU)).__name__ == "TorchAttention"


@pytest.mark.parametrize("plat,machine", [("darwin", "arm64"), ("win32", "AMD64")])
def test_no_wheel_platforms_are_told_so(no_triton, monkeypatch, plat, machine):
    monkeypatch.setattr(sys, "platform", plat)
    monkeypatch.setattr(s4.platform, "machine", lambda: machine)
    with pytest.raises(s4.TritonUnavailableError) as e:
        s4.require_triton()
    msg = str(e.value)
    assert f"no wheel for {plat}/{machine}" in msg and "attention_backend='torch'" in msg
    assert "pip install triton" not in msg


@pytest.mark.parametrize("installed", [False, True])
@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("interpret", [None, "0", "1"])
def test_triton_available_agrees_with_require_triton(monkeypatch, installed, cuda, interpret):
    """``triton_available()`` is True exactly when triton imports and there is CUDA or
    TRITON_INTERPRET=1, and exactly then ``require_triton()`` lets rung 4 run (a stand-in module
    plays an installed triton >= 3.7, so this runs the same with or without the real one)."""
    monkeypatch.setitem(sys.modules, "triton",
                        types.SimpleNamespace(__version__="3.7.1") if installed else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    expected = installed and (cuda or interpret == "1")
    assert s4.triton_available() is expected
    if expected:
        s4.require_triton()
    else:
        with pytest.raises(s4.TritonUnavailableError):
            s4.require_triton()


def test_interpreter_switched_off_without_cuda(monkeypatch):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernels run natively")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(s4.TritonUnavailableError, match="TRITON_INTERPRET='0'"):
        s4.require_triton()


def test_old_interpreter_with_new_numpy_is_refused(monkeypatch):
    """triton < 3.7's CPU interpreter fails deep inside a kernel with numpy >= 2.4: say so first."""
    if torch.cuda.is_available():
        pytest.skip("with CUDA the kernels run natively")
    import numpy
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    assert not s4.triton_available()
    with pytest.raises(s4.TritonUnavailableError, match=r"triton 3\.6\.0 fails with numpy 2\.4\.0"):
        s4.require_triton()
    monkeypatch.setattr(numpy, "__version__", "2.3.5")
    assert s4.triton_available()
    s4.require_triton()
    monkeypatch.setattr(numpy, "__version__", "2.4.0")
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.7.1"))
    assert s4.triton_available()
    s4.require_triton()


def test_everything_but_step4_runs_without_triton():
    r = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok")


def test_lora_kernel_triton_without_triton_is_an_error_naming_it(no_triton, tiny):
    """Rung 13's Triton BGMV where Triton cannot be imported: refused when the engine is made,
    naming the option, never mid-step."""
    from minillm import LLM
    with pytest.raises(ValueError, match="lora_kernel='triton' cannot run here"):
        LLM(tiny, engine="paged", enable_lora=True, lora_kernel="triton")
