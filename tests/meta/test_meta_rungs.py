"""Rungs plug into the core instead of copying it: rungs 7 and 12 define no step loop
of their own (the core's one step serves them), no engine class derives from two engines, and
the core's ``Scheduler.schedule`` takes no rung's concern as a parameter. Each check has a
self-test on a planted violation."""
from __future__ import annotations

import ast

from architecture import (
    PKG, engine_classes, find_function, methods_named, module_name, multiple_engine_bases, parse,
    schedule_signature_problems, sources,
)

STEP_FREE = ("r7_pipeline", "r12_realtime")


# --- no step loop of their own ----------------------------------------------------------------

def test_rungs_7_and_12_define_no_step():
    bad = methods_named(sources(*(PKG / "engines" / r for r in STEP_FREE)), "_step")
    print("\n  " + "\n  ".join(bad))
    assert bad == [], "the core's step serves these rungs:\n  " + "\n  ".join(bad)


def test_self_test_planted_step_is_reported():
    planted = {"minillm/engines/r7_pipeline/engine.py":
               "class PipelineEngine(PagedEngine):\n    def step(self):\n        pass\n\n"
               "    def _step(self):\n        return 1\n\n"
               "def _step():\n    pass\n"}
    assert methods_named(planted, "_step") == ["minillm/engines/r7_pipeline/engine.py:5 "
                                               "PipelineEngine._step"]
    assert methods_named({"minillm/engines/r12_realtime/x.py": "class A:\n    def step(self): "
                          "pass\n"}, "_step") == []


# --- one engine base at most ----------------------------------------------------------------

def test_no_engine_derives_from_two_engines():
    """Across minillm/core and minillm/engines, an engine class (one whose bases chain reaches
    ``runtime.interface.Engine``, resolved through the imports of every module) has one engine
    among its direct bases; a rung's feature is a component, not a second engine base."""
    files = sources(PKG)
    engines = engine_classes(files)
    named = {(module_name(p), n.name) for p, t in files.items() for n in parse(t).body
             if isinstance(n, ast.ClassDef) and n.name.endswith("Engine")
             and p.startswith(("minillm/core/", "minillm/engines/"))}
    assert named and named <= set(engines), (
        f"the check does not see these as engines (a base it cannot resolve?): "
        f"{sorted(named - set(engines))}")
    bad = multiple_engine_bases(files, under=("minillm.core", "minillm.engines"))
    print("\n  " + "\n  ".join(bad))
    assert bad == [], "engines with two engine bases:\n  " + "\n  ".join(bad)


def test_self_test_two_engine_bases_are_reported():
    planted = {
        "minillm/runtime/__init__.py": "",
        "minillm/runtime/interface.py": "class Engine:\n    pass\n",
        "minillm/core/__init__.py": "from .engine import PagedEngine\n",          # re-export
        "minillm/core/engine.py": "from ..runtime.interface import Engine\n"
                                  "class PagedEngine(Engine):\n    pass\n",
        "minillm/engines/__init__.py": "",
        "minillm/engines/base.py": "from ..runtime import interface\n"
                                   "class ContiguousEngine(interface.Engine):\n    pass\n",
        "minillm/engines/r9_both.py": (
            "import minillm.engines.base\n"
            "from ..core import PagedEngine as Paged\n"
            "class Mixin:\n    pass\n"
            "class One(Paged, Mixin):\n    pass\n"
            "class Both(Mixin, Paged, minillm.engines.base.ContiguousEngine):\n    pass\n"
            "class Deeper(One):\n    pass\n"
            "class AlsoBoth(Deeper, One):\n    pass\n"),
    }
    assert sorted(engine_classes(planted)) == [
        ("minillm.core.engine", "PagedEngine"), ("minillm.engines.base", "ContiguousEngine"),
        ("minillm.engines.r9_both", "AlsoBoth"), ("minillm.engines.r9_both", "Both"),
        ("minillm.engines.r9_both", "Deeper"), ("minillm.engines.r9_both", "One")]
    assert multiple_engine_bases(planted) == [
        "minillm/engines/r9_both.py:7 Both: minillm.core.engine.PagedEngine, "
        "minillm.engines.base.ContiguousEngine",
        "minillm/engines/r9_both.py:11 AlsoBoth: minillm.engines.r9_both.Deeper, "
        "minillm.engines.r9_both.One"]
    assert multiple_engine_bases(planted, under=("minillm.core",)) == []


# --- the scheduler's one question -------------------------------------------------------------

def test_schedule_takes_no_rung_concern():
    path = PKG / "core" / "scheduler.py"
    fn = find_function(path.read_text(), "Scheduler", "schedule")
    assert fn is not None, "minillm/core/scheduler.py defines no Scheduler.schedule"
    bad = schedule_signature_problems(fn)
    print("\n  " + "\n  ".join(f"minillm/core/scheduler.py {b}" for b in bad))
    assert bad == [], "Scheduler.schedule:\n  " + "\n  ".join(bad)


def test_self_test_planted_schedule_signatures():
    planted = ("class Scheduler:\n"
               "    def schedule(self, exclude=(),\n"
               "                 max_new=None, admit=None):\n        pass\n"
               "class Other:\n    def schedule(self, budget, *, admit=None):\n        pass\n")
    fn = find_function(planted, "Scheduler", "schedule")
    assert fn.lineno == 2
    assert schedule_signature_problems(fn) == [
        "line 2: 3 parameters (exclude, max_new, admit), at most 1",
        "line 2: parameter 'exclude' is a rung's concern",
        "line 3: parameter 'max_new' is a rung's concern",
        "line 3: parameter 'admit' is a rung's concern"]
    assert schedule_signature_problems(find_function(planted, "Other", "schedule")) == [
        "line 6: 2 parameters (budget, admit), at most 1",
        "line 6: parameter 'admit' is a rung's concern"]
    for ok in ("def schedule(self): pass", "def schedule(self, budget=None): pass"):
        assert schedule_signature_problems(ast.parse(ok).body[0]) == [], ok
    assert schedule_signature_problems(ast.parse("def schedule(self, admit): pass").body[0]) == [
        "line 1: parameter 'admit' is a rung's concern"]
    assert find_function(planted, "Scheduler", "missing") is None
