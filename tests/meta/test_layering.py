"""The core owns the engine interface, and views ask engines only what the interface declares:
static checks over the package's source, each with a self-test that it catches a
planted violation. (``test_layout.py`` checks the ladder's files, names and lengths.)"""
from __future__ import annotations

import ast
from pathlib import Path

from architecture import sources, strongly_connected   # (tests/meta/architecture.py)

PKG = Path(__file__).resolve().parents[2] / "minillm"
VIEWS = [PKG / "serve", PKG / "viz", PKG / "__main__.py", PKG / "llm.py"]


def type_only(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (never run: not a real dependency)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imported_modules(path: str, text: str, runtime_only: bool = False) -> list[tuple[int, str]]:
    """Every module ``text`` imports (function-local imports included), as absolute names;
    ``runtime_only``: without the imports under ``if TYPE_CHECKING:``."""
    package = path.removesuffix(".py").replace("/", ".").split(".")
    if package[-1] == "__init__":
        package = package[:-1]
    tree = ast.parse(text)
    skip = type_only(tree) if runtime_only else set()
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [(node.lineno, f"{mod}.{a.name}" if not node.module else mod)
                    for a in node.names]
    return out


def core_imports_of_engines(files: dict[str, str]) -> list[str]:
    return [f"{path}:{line} imports {mod}" for path, text in files.items()
            for line, mod in imported_modules(path, text)
            if mod == "minillm.engines" or mod.startswith("minillm.engines.")]


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """Modules that import each other, directly or round a circle, counting function-local
    imports (which hide a circle from Python, not from a reader); type-only imports aside."""
    names = {path.removesuffix(".py").replace("/", ".").removesuffix(".__init__"): path
             for path in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        graph[name] = set()
        for _, mod in imported_modules(path, files[path], runtime_only=True):
            parts = mod.split(".")
            while parts and ".".join(parts) not in names:
                parts.pop()
            target = ".".join(parts)
            # a package's __init__ is imported on the way to its modules: not an edge of theirs
            if parts and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return strongly_connected(graph)


def factories_with_side_effects(files: dict[str, str]) -> list[str]:
    """``make_runner`` (called inside ``PagedEngine.__init__``) assigning to ``self``: state a
    subclass sets half-way through its base's constructor. The runner holds what it needs."""
    bad = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name == "make_runner":
                for sub in ast.walk(node):
                    targets = (sub.targets if isinstance(sub, ast.Assign) else
                               [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign))
                               else [])
                    for t in targets:
                        for leaf in ast.walk(t):
                            if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                                    and leaf.value.id == "self"):
                                bad.append(f"{path}:{sub.lineno} {ast.unparse(t)}")
    return bad


def config_aliases(files: dict[str, str]) -> list[str]:
    """A property or attribute giving a config a second name (``self.config =
    self.speculative_config``, a property returning ``self.tensor_parallel_config``)."""
    bad = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            value = None
            if isinstance(node, ast.Assign) and any(
                    isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                    and leaf.value.id == "self" for t in node.targets for leaf in ast.walk(t)):
                value = node.value                      # (a local name for a config is fine)
            elif isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d) == "property" for d in node.decorator_list):
                returns = [r.value for r in ast.walk(node) if isinstance(r, ast.Return)]
                value = returns[0] if len(returns) == 1 and len(node.body) <= 2 else None
            if (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)
                    and value.value.id == "self" and value.attr.endswith("_config")):
                bad.append(f"{path}:{node.lineno} {ast.unparse(value)}")
    return bad


def getattr_on_engines(files: dict[str, str]) -> list[str]:
    """getattr/hasattr whose object is an engine (a name or attribute mentioning one)."""
    bad = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and "eng" in ast.unparse(node.args[0]).lower()):
                bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return bad


def private_reads(files: dict[str, str]) -> list[str]:
    """``x._member`` where x is not ``self``/``cls``: another object's private member (a
    ``_sunder_`` name is a public protocol, IPython's ``_repr_mimebundle_``)."""
    bad = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and not node.attr.endswith("_")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return bad


def step_copies(files: dict[str, str]) -> list[str]:
    """A rung calling what the core's ``land`` does inside (``complete``, ``update_from_output``,
    ``split_step_time``) rebuilds that part of the step instead of passing through the phase (a
    rung that rescales a step's time with ``split_step_time(out, sched, 1.0)`` and calls
    ``complete`` itself copies the core's commit)."""
    bad = []
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            name = (node.func.attr if isinstance(node.func, ast.Attribute) else
                    node.func.id if isinstance(node.func, ast.Name) else None)
            if name in ("complete", "update_from_output", "split_step_time"):
                bad.append(f"{path}:{node.lineno} {ast.unparse(node.func)}")
    return bad


def test_nothing_in_core_imports_the_ladder():
    assert core_imports_of_engines(sources(PKG / "core")) == []


def test_no_import_cycles_even_hidden_in_functions():
    assert import_cycles(sources(PKG)) == []


def test_rungs_share_distributed_plumbing_through_dist_not_rung_7():
    """Rung 11 (and 10's workers) start processes and talk between ranks through ``dist/``;
    rung 11 does not depend on rung 7 at all."""
    disagg = sources(PKG / "engines" / "r11_disagg")
    assert [f"{p}:{line} {m}" for p, t in disagg.items() for line, m in imported_modules(p, t)
            if "r7_pipeline" in m] == []
    assert all("r7_pipeline" not in m for p, t in sources(PKG / "dist").items()
               for _, m in imported_modules(p, t))


def test_engines_are_built_without_init_order_tricks():
    engines = sources(PKG / "core", PKG / "engines")
    assert factories_with_side_effects(engines) == []
    assert config_aliases(engines) == []


def test_rungs_extend_the_step_through_its_phases():
    assert step_copies(sources(PKG / "engines")) == []


def test_views_ask_engines_through_declared_methods():
    views = sources(*VIEWS)
    assert getattr_on_engines(views) == []
    assert private_reads(views) == []


def test_the_checks_catch_planted_violations():
    planted = {"minillm/core/x.py": "def f():\n    from ..engines.base import ContiguousEngine\n",
               "minillm/core/y.py": "import minillm.engines.r0_naive\n",
               "minillm/core/z.py": "from .. import engines\n"}
    assert len(core_imports_of_engines(planted)) == 3
    assert core_imports_of_engines({"minillm/core/ok.py": "from .interface import Engine\n"}) == []
    view = {"minillm/serve/v.py": "a = getattr(loop.engine, 'scheduler', None)\n"
                                  "b = hasattr(eng, 'stages')\nc = loop._thread\n"
                                  "d = self._ok\ne = getattr(obj, 'x')\n"
                                  "f = w._repr_mimebundle_()\n"}
    assert len(getattr_on_engines(view)) == 2
    assert private_reads(view) == ["minillm/serve/v.py:3 loop._thread"]
    circle = {"minillm/a.py": "from . import b\n",
              "minillm/b.py": "def f():\n    from .c import x\n",
              "minillm/c.py": "from .a import y\n",
              "minillm/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .e import E\n",
              "minillm/e.py": "from .d import D\n"}
    assert import_cycles(circle) == [["minillm.a", "minillm.b", "minillm.c"]]
    engine = {"minillm/engines/x.py": "class E:\n"
              "    def make_runner(self, n):\n        self.stage = n\n        return R(n)\n"
              "    @property\n    def parallel_config(self):\n"
              "        return self.tensor_parallel_config\n"
              "    def __init__(self):\n        cfg = self.config = self.speculative_config\n"
              "        ok = self.cache_config.block_size\n"
              "        c = self.parallel_config\n"}
    assert factories_with_side_effects(engine) == ["minillm/engines/x.py:3 self.stage"]
    copied = {"minillm/engines/p.py": "class P:\n    def land(self, mb, out):\n"
              "        split_step_time(split, mb.sched, 1.0)\n        self.complete(r, l, out)\n"
              "        super().finish_step((r, l), out)\n"}
    assert step_copies(copied) == ["minillm/engines/p.py:3 split_step_time",
                                   "minillm/engines/p.py:4 self.complete"]
    assert len(config_aliases(engine)) == 2
