"""Imports tell the architecture: no circle among minillm's modules, every import
points down the layers (runtime < layers < core < engines < consumers; shared modules below all
of them but core's and the ladder's), and a rung builds only on lower rungs. Static: source text
only; each check has a self-test on planted sources."""
from __future__ import annotations

import pytest
from architecture import (
    PKG, cycle_witnesses, import_cycles, import_edges, layer_of, layer_violations, module_name,
    rung_violations, sources,
)


@pytest.fixture(scope="module")
def package() -> dict[str, str]:
    files = sources(PKG)
    import_edges(files)           # parse the ~200 files once, here (every check below reuses it)
    return files


def report(findings: list[str]) -> str:
    return "\n  " + "\n  ".join(findings)


# --- no circle --------------------------------------------------------------------------------

def test_no_import_circle_counting_type_only_and_local_imports(package):
    circles = import_cycles(package)
    lines = [f"{', '.join(c)}:" + report(cycle_witnesses(package, c)) for c in circles]
    print("\n".join(lines))
    assert circles == [], "import circles:\n" + "\n".join(lines)


def test_self_test_circle_through_type_checking_is_reported():
    planted = {"minillm/a.py": "from . import b\n",
               "minillm/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from .a import A\n"}
    assert import_cycles(planted) == [["minillm.a", "minillm.b"]]
    assert cycle_witnesses(planted, ["minillm.a", "minillm.b"]) == [
        "minillm/a.py:1 imports minillm.b", "minillm/b.py:3 imports minillm.a"]


def test_self_test_circle_through_function_local_and_relative_imports():
    planted = {"minillm/core/__init__.py": "",
               "minillm/core/engine.py": "def f():\n    from ..engines.r6 import X\n",
               "minillm/engines/__init__.py": "",
               "minillm/engines/r6.py": "from ..core import engine\n",      # y is a submodule
               "minillm/x.py": "from .y import z\n",                         # z is a name in y
               "minillm/y.py": "import minillm.x.q\n",                       # longest module: x
               "minillm/ok.py": "from .core.engine import E\nimport os\n"}
    assert import_cycles(planted) == [["minillm.core.engine", "minillm.engines.r6"],
                                      ["minillm.x", "minillm.y"]]
    assert import_cycles({"minillm/ok.py": "from . import ok2\n", "minillm/ok2.py": ""}) == []


def test_self_test_relative_imports_resolve_to_modules():
    planted = {"minillm/__init__.py": "", "minillm/core/__init__.py": "X = 1\n",
               "minillm/core/a.py": "from . import b, X\nfrom .b import c\nfrom .. import memory\n"
                                    "from ..core.b import f\nfrom ... import outside\n",
               "minillm/core/b.py": "", "minillm/memory.py": ""}
    edges = import_edges(planted)["minillm.core.a"]
    assert edges == [(1, "minillm.core.b"), (1, "minillm.core"), (2, "minillm.core.b"),
                     (3, "minillm.memory"), (4, "minillm.core.b")]
    assert module_name("minillm/core/__init__.py") == "minillm.core"


# --- direction --------------------------------------------------------------------------------

def test_self_test_layers_are_named():
    assert [layer_of(m) for m in ("minillm.runtime.driver", "minillm.layers.fused",
                                  "minillm.core.engine", "minillm.engines.r6_speculative.engine",
                                  "minillm.serve.app", "minillm.llm", "minillm", "minillm.__main__",
                                  "minillm.gpu_check", "minillm.memory", "minillm.dist.comm",
                                  "torch")] == [
        "runtime", "layers", "core", "engines", "consumers", "consumers", "consumers",
        "consumers", "consumers", "shared", "shared", None]


@pytest.mark.parametrize("layer", [
    "runtime", "layers", "core",
    "engines", "shared",
])
def test_imports_point_down_the_layers(package, layer):
    """A module imports its own layer or lower ones (or a shared module); a shared module imports
    no core, engine or consumer."""
    bad = [f for f in layer_violations(package) if f.split(" (", 2)[1].startswith(layer + ")")]
    print(report(bad))
    assert bad == [], f"{layer} imports upward:" + report(bad)


def test_self_test_upward_imports_are_reported():
    planted = {"minillm/runtime/x.py": "import minillm.core.engine\n",
               "minillm/layers/y.py": "def f():\n    from ..engines import REGISTRY\n",
               "minillm/core/engine.py": "from ..runtime.x import X\nfrom ..memory import M\n",
               "minillm/engines/__init__.py": "from ..serve import app\n",
               "minillm/serve/app.py": "from ..engines import REGISTRY\n",
               "minillm/memory.py": "from .core.engine import E\nfrom .runtime import x\n",
               "minillm/dist/comm.py": "from ..llm import LLM\n",
               "minillm/llm.py": "from .engines import REGISTRY\n"}
    assert layer_violations(planted) == [
        "minillm/runtime/x.py:1 (runtime) imports minillm.core.engine (core)",
        "minillm/layers/y.py:2 (layers) imports minillm.engines (engines)",
        "minillm/engines/__init__.py:1 (engines) imports minillm.serve.app (consumers)",
        "minillm/memory.py:1 (shared) imports minillm.core.engine (core)",
        "minillm/dist/comm.py:1 (shared) imports minillm.llm (consumers)"]


# --- rungs build on lower rungs ---------------------------------------------------------------

def test_rungs_import_only_lower_rungs(package):
    bad = rung_violations(package)
    print(report(bad))
    assert bad == [], "a rung imports a higher one:" + report(bad)


def test_self_test_higher_rung_imports_are_reported():
    planted = {"minillm/engines/r6_speculative/__init__.py": "",
               "minillm/engines/r6_speculative/engine.py":
                   "from ...core.engine import PagedEngine\nfrom ..r5_allocators import C\n"
                   "def f():\n    from ..r12_realtime.config import AsyncConfig\n",
               "minillm/engines/r12_realtime/__init__.py": "",
               "minillm/engines/r12_realtime/config.py": "from ..r6_speculative import engine\n",
               "minillm/engines/r5_allocators/__init__.py": "",
               "minillm/engines/r10_tensor.py": "import minillm.engines.r6_speculative.engine\n",
               "minillm/engines/base.py": "from .r1_static import S\n",
               "minillm/engines/r1_static.py": "from .base import B\nfrom .padded import P\n",
               "minillm/engines/padded.py": "",
               "minillm/engines/__init__.py": "from .r12_realtime import config\n",
               "minillm/core/engine.py": ""}
    assert rung_violations(planted) == [
        "minillm/engines/r6_speculative/engine.py:4 (rung 6) imports "
        "minillm.engines.r12_realtime.config (rung 12)",
        "minillm/engines/base.py:1 (rung None) imports minillm.engines.r1_static (rung 1)"]
