"""The core owns the engine interface, and views ask engines only what the interface declares
(issue 41): static checks over the package's source, each with a self-test that it catches a
planted violation. (``test_layout.py`` checks the ladder's files, names and lengths.)"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "minillm"
VIEWS = [PKG / "serve", PKG / "viz", PKG / "__main__.py", PKG / "llm.py"]


def sources(*roots: Path) -> dict[str, str]:
    files = [f for r in roots for f in ([r] if r.is_file() else sorted(r.rglob("*.py")))]
    return {str(f.relative_to(PKG.parent)): f.read_text() for f in files}


def imported_modules(path: str, text: str) -> list[tuple[int, str]]:
    """Every module ``text`` imports (function-local imports included), as absolute names."""
    package = path.removesuffix(".py").replace("/", ".").split(".")
    if package[-1] == "__init__":
        package = package[:-1]
    out = []
    for node in ast.walk(ast.parse(text)):
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


def test_nothing_in_core_imports_the_ladder():
    assert core_imports_of_engines(sources(PKG / "core")) == []


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
