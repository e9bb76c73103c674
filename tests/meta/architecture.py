"""Static architecture checks over minillm's source: pure functions over source text,
so each check's self-test can feed it planted sources.

Sources are a dict ``{"minillm/core/engine.py": text, ...}``: paths relative to the repository
root, with ``/`` separators. Every check returns a list of findings (``"path:line what"``) or of
circles; an empty list is a pass.

The layers, lowest first (a module may import its own layer and lower ones)::

    runtime  <  layers  <  core  <  engines  <  consumers (serve, viz, lab, bench, and the entry
                                                points __init__, llm, __main__, gpu_check)

Shared modules (every other top-level ``minillm/*.py``, and ``minillm/dist/``) may be imported
by anyone; they themselves must not import core, engines or a consumer.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "minillm"

# ---------------------------------------------------------------------------------------------
# reading sources


def sources(*roots: Path) -> dict[str, str]:
    """Every ``*.py`` under ``roots`` (a root may be one file), keyed by its repo-relative path."""
    files = [f for r in roots for f in ([r] if r.is_file() else sorted(r.rglob("*.py")))]
    return {f.relative_to(ROOT).as_posix(): f.read_text() for f in files}


def module_name(path: str) -> str:
    """``minillm/core/engine.py`` -> ``minillm.core.engine``; a package's ``__init__.py`` is the
    package itself."""
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def is_package(path: str) -> bool:
    return path.endswith("/__init__.py") or path == "__init__.py"


@lru_cache(maxsize=None)
def parse(text: str) -> ast.Module:
    """``ast.parse``, once per text: every check walks the same ~200 files (read-only trees)."""
    return ast.parse(text)


# ---------------------------------------------------------------------------------------------
# imports


def statements(tree: ast.AST):
    """Every statement under ``tree``, nested ones included (function bodies, ``if``, ``try``,
    ``with``, ``match`` ...), without walking expressions: imports are statements."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.stmt):
            yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            todo.extend(reversed(getattr(node, name, None) or ()))


def from_module(path: str, node: ast.ImportFrom) -> str:
    """The absolute module of ``from M import ...`` written in ``path`` (relative ones resolved:
    level 1 is the file's package, each further level one package up)."""
    me = module_name(path).split(".")
    package = me if is_package(path) else me[:-1]
    base = package[:max(len(package) - (node.level - 1), 0)] if node.level else []
    return ".".join(base + ([node.module] if node.module else []))


@lru_cache(maxsize=None)
def raw_imports(path: str, text: str) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """Every import statement in ``text`` (module level, function-local, under ``if
    TYPE_CHECKING:``, inside ``try:``: all of them), as ``(line, absolute module, names)``:
    ``names`` are the imported names of a ``from M import a, b`` (they may be submodules of M),
    empty for ``import M``. Relative imports are resolved against ``path``'s package."""
    out = []
    for node in statements(parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, from_module(path, node),
                        tuple(a.name for a in node.names if a.name != "*")))
    return tuple(sorted(out, key=lambda t: t[0]))


def _longest_known(name: str, known: set[str]) -> str | None:
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else None


def import_edges(files: dict[str, str]) -> dict[str, list[tuple[int, str]]]:
    """module -> ``[(line, imported module), ...]``, for imports of modules in ``files`` only.
    ``from M import y`` is an import of ``M.y`` when that is a module of ``files`` (a submodule),
    else of ``M``; ``import a.b.c`` is an import of its longest prefix that is a module. The
    packages Python runs on the way to a module (``a``, ``a.b``) are not edges: every module
    would otherwise sit in a circle with ``minillm/__init__.py``."""
    known = {module_name(p) for p in files}
    edges: dict[str, list[tuple[int, str]]] = {}
    for path, text in files.items():
        me = module_name(path)
        found = []
        for line, mod, names in raw_imports(path, text):
            targets = [t for n in names if (t := f"{mod}.{n}") in known]
            if len(targets) < len(names) or not names:     # some name is not a submodule
                if (t := _longest_known(mod, known)) is not None:
                    targets.append(t)
            found += [(line, t) for t in targets if t != me]
        edges[me] = found
    return edges


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """Every circle of imports (a strongly connected component of more than one module, or a
    module importing itself), as a sorted list of module names; circles sorted too."""
    graph = {m: {t for _, t in e} for m, e in import_edges(files).items()}
    return sorted(strongly_connected(graph))


def cycle_witnesses(files: dict[str, str], cycle: list[str]) -> list[str]:
    """The import lines that make up ``cycle`` (for the failure message)."""
    members = set(cycle)
    paths = {module_name(p): p for p in files}
    return [f"{paths[m]}:{line} imports {t}" for m, edges in import_edges(files).items()
            if m in members for line, t in edges if t in members]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (deterministic: nodes and edges visited in sorted order)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph.get(v, ()):
                    found.append(sorted(comp))
    return found


# ---------------------------------------------------------------------------------------------
# layers

LAYERS = ("runtime", "layers", "core", "engines", "consumers")
CONSUMER_PACKAGES = ("serve", "viz", "lab", "bench")
ENTRY_POINTS = ("__init__", "llm", "__main__", "gpu_check")
SHARED = "shared"
# what a shared module (top-level minillm/*.py, minillm/dist/) must not import
SHARED_MUST_NOT = ("core", "engines", "consumers")


def layer_of(module: str) -> str | None:
    """The layer of a module of minillm (``None`` outside minillm): one of LAYERS, or SHARED."""
    parts = module.split(".")
    if parts[0] != "minillm":
        return None
    if len(parts) == 1:
        return "consumers"                                   # minillm/__init__.py
    top = parts[1]
    if top in ("runtime", "layers", "core", "engines"):
        return top
    if top in CONSUMER_PACKAGES or (len(parts) == 2 and top in ENTRY_POINTS):
        return "consumers"
    return SHARED                                            # dist/, and every other minillm/*.py


def layer_violations(files: dict[str, str]) -> list[str]:
    """Imports against the layer order: a module of a layer importing a higher layer, or a shared
    module importing core, engines or a consumer."""
    bad = []
    paths = {module_name(p): p for p in files}
    for me, edges in import_edges(files).items():
        mine = layer_of(me)
        for line, target in edges:
            theirs = layer_of(target)
            if mine is None or theirs is None or theirs == SHARED:
                continue
            if mine == SHARED:
                wrong = theirs in SHARED_MUST_NOT
            else:
                wrong = LAYERS.index(theirs) > LAYERS.index(mine)
            if wrong:
                bad.append(f"{paths[me]}:{line} ({mine}) imports {target} ({theirs})")
    return bad


# ---------------------------------------------------------------------------------------------
# rungs

_RUNG = re.compile(r"^minillm\.engines\.r(\d+)_\w+")


def rung_of(module: str) -> int | None:
    """N for a module of ``minillm/engines/rN_name(.py|/)``; None for any other module."""
    m = _RUNG.match(module)
    return int(m.group(1)) if m else None


def rung_violations(files: dict[str, str]) -> list[str]:
    """A rung importing a higher-numbered rung; or one of the ladder's shared pieces
    (``engines/base.py``, ``engines/padded.py``) importing any rung."""
    bad = []
    paths = {module_name(p): p for p in files}
    for me, edges in import_edges(files).items():
        if not me.startswith("minillm.engines."):
            continue                                    # (the registry, engines/__init__, is free)
        mine = rung_of(me)
        for line, target in edges:
            theirs = rung_of(target)
            if theirs is None:
                continue
            if mine is None or theirs > mine:
                bad.append(f"{paths[me]}:{line} (rung {mine}) imports {target} (rung {theirs})")
    return bad


# ---------------------------------------------------------------------------------------------
# the core: size and vocabulary

LATER_RUNG_WORDS = ("lora", "slo", "tpot", "async", "pipeline", "disagg", "speculative")

# camelCase / CamelCase / ACRONYM parts of one snake_case part
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
# a string literal checked as a name: an identifier, a dotted name, or an option (--foo-bar)
_NAME_LIKE = re.compile(r"-{0,2}[A-Za-z_][A-Za-z0-9_.\-]*")


def word_parts(identifier: str) -> list[str]:
    """``slo_ttft_ms`` -> [slo, ttft, ms]; ``LoRAConfig`` -> [lo, ra, config]; lower case."""
    return [p.lower() for chunk in re.split(r"[^A-Za-z0-9]+", identifier)
            for p in _CAMEL.findall(chunk)]


def words_in(identifier: str, words=LATER_RUNG_WORDS) -> list[str]:
    """The ``words`` that are a run of ``identifier``'s parts (so ``LoRAConfig``'s ``lo`` +
    ``ra`` is ``lora``; ``slots`` and ``asyncio`` hold no word: parts, not substrings)."""
    parts = word_parts(identifier)
    hits = []
    for word in words:
        for i in range(len(parts)):
            joined = ""
            for p in parts[i:]:
                joined += p
                if joined == word:
                    hits.append(word)
                    break
                if not word.startswith(joined):
                    break
            if word in hits:
                break
    return hits


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                out.add(id(body[0].value))
    return out


@lru_cache(maxsize=None)
def code_names(text: str) -> tuple[tuple[int, str], ...]:
    """Every name the code spells, with its line: names, attributes, function/class/parameter
    names, keyword-argument names, import names and aliases, ``async`` as a keyword, and the
    string literals that are a name or an option (``"slo_ttft_ms"``, ``"--async-scheduling"``;
    not prose, not docstrings). Comments are not code."""
    tree = parse(text)
    docstrings = _docstring_nodes(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            out.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((getattr(node, "end_lineno", line) or line, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((line, node.name))
        elif isinstance(node, ast.arg):
            out.append((line, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((line, node.arg))
        elif isinstance(node, ast.alias):
            out += [(line, n) for n in (node.name, node.asname) if n]
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            out += [(line, n) for n in node.names]
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.append((line, node.name))
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            out.append((line, node.name))
        elif isinstance(node, ast.MatchMapping) and node.rest:
            out.append((line, node.rest))
        elif isinstance(node, (ast.MatchClass,)):
            out += [(line, k) for k in node.kwd_attrs]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((line, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings and _NAME_LIKE.fullmatch(node.value.strip()):
                out.append((line, node.value.strip()))
        if isinstance(node, (ast.AsyncFunctionDef, ast.AsyncFor, ast.AsyncWith)):
            out.append((line, "async"))
    return tuple(sorted(out))


def later_rung_names(files: dict[str, str], words=LATER_RUNG_WORDS) -> list[str]:
    """``path:line name [words]`` for every code name holding a later rung's word."""
    bad = []
    for path, text in files.items():
        seen = set()
        for line, name in code_names(text):
            hits = words_in(name, words)
            if hits and (line, name) not in seen:
                seen.add((line, name))
                bad.append(f"{path}:{line} {name} [{', '.join(hits)}]")
    return bad


def python_lines(files: dict[str, str]) -> dict[str, int]:
    """Lines per file (every line, as ``wc -l`` counts them)."""
    return {path: len(text.splitlines()) for path, text in files.items()}


# ---------------------------------------------------------------------------------------------
# the rungs' shape


def methods_named(files: dict[str, str], name: str) -> list[str]:
    """``path:line Class.name`` for every method ``name`` defined in a class (at any depth)."""
    bad = []
    for path, text in files.items():
        for cls in ast.walk(parse(text)):
            if isinstance(cls, ast.ClassDef):
                for node in cls.body:
                    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and node.name == name):
                        bad.append(f"{path}:{node.lineno} {cls.name}.{name}")
    return bad


ENGINE = ("minillm.runtime.interface", "Engine")


def class_table(files: dict[str, str]) -> dict[tuple[str, str], tuple[str, int, list]]:
    """``(module, class) -> (path, line, bases)`` for every module-level class in ``files``;
    ``bases`` as written (``ast`` expressions)."""
    table = {}
    for path, text in files.items():
        for node in parse(text).body:
            if isinstance(node, ast.ClassDef):
                table[(module_name(path), node.name)] = (path, node.lineno, node.bases)
    return table


def _bindings(files: dict[str, str], module: str) -> dict[str, tuple[str, str | None]]:
    """What each imported name of ``module`` stands for: ``name -> (module, attribute)``
    (``from M import a as b``: b -> (M, a); ``import x.y as z``: z -> (x.y, None))."""
    paths = {module_name(p): p for p in files}
    path = paths[module]
    out: dict[str, tuple[str, str | None]] = {}
    for node in statements(parse(files[path])):
        if isinstance(node, ast.Import):
            out.update({a.asname: (a.name, None) for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom):
            out.update({a.asname or a.name: (from_module(path, node), a.name)
                        for a in node.names})
    return out


def resolve_name(files: dict[str, str], module: str, dotted: str,
                 _seen: frozenset = frozenset()) -> tuple[str, str] | str | None:
    """What ``dotted`` (``Name`` or ``alias.Name``) used at module level of ``module`` is:
    ``(module, class)`` for a class of ``files``, following ``from X import name [as alias]``
    (relative ones too) and a package's re-exports; a module name for a module of ``files``;
    None for anything else."""
    paths = {module_name(p): p for p in files}
    if module not in paths or (module, dotted) in _seen:
        return None
    _seen = _seen | {(module, dotted)}
    head, _, rest = dotted.partition(".")
    found: tuple[str, str] | str | None = None
    tree = parse(files[paths[module]])
    if any(isinstance(n, ast.ClassDef) and n.name == head for n in tree.body):
        found = (module, head)
    elif head in (binding := _bindings(files, module)):
        mod, attr = binding[head]
        if attr is None:
            found = mod if mod in paths else None
        elif f"{mod}.{attr}" in paths:
            found = f"{mod}.{attr}"                      # a submodule
        else:
            found = resolve_name(files, mod, attr, _seen)
    elif dotted in paths:                                # import minillm.core.engine
        return dotted
    elif "." in dotted and (mod := dotted.rpartition(".")[0]) in paths:
        return resolve_name(files, mod, dotted.rpartition(".")[2], _seen)
    if not rest or found is None:
        return found
    if isinstance(found, str):                           # a module: look the rest up there
        return resolve_name(files, found, rest, _seen)
    return None                                          # (a class's attribute: not a class)


def _base_names(module: str, base: ast.expr, files: dict[str, str]) -> tuple[str, str] | None:
    if isinstance(base, (ast.Name, ast.Attribute)):
        found = resolve_name(files, module, ast.unparse(base))
        return found if isinstance(found, tuple) else None
    return None


def engine_classes(files: dict[str, str], engine: tuple[str, str] = ENGINE
                   ) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Every class of ``files`` whose bases chain reaches ``engine`` (itself aside), with its
    direct bases that are ``engine`` or reach it."""
    table = class_table(files)
    bases = {key: [b for b in (_base_names(key[0], e, files) for e in info[2]) if b]
             for key, info in table.items()}
    memo: dict[tuple[str, str], bool] = {engine: True}

    def is_engine(key, stack=()):
        if key not in memo:
            memo[key] = False if key in stack else any(
                is_engine(b, stack + (key,)) for b in bases.get(key, ()))
        return memo[key]

    return {key: [b for b in bases[key] if is_engine(b)] for key in sorted(table)
            if key != engine and is_engine(key)}


def multiple_engine_bases(files: dict[str, str], under: tuple[str, ...] = (),
                          engine: tuple[str, str] = ENGINE) -> list[str]:
    """``path:line Class: Base1, Base2`` for every engine class (in a module under one of
    ``under``, every module when empty) deriving directly from two or more engine classes."""
    table = class_table(files)
    bad = []
    for key, engine_bases in engine_classes(files, engine).items():
        if under and not any(key[0] == u or key[0].startswith(u + ".") for u in under):
            continue
        if len(engine_bases) >= 2:
            path, line, _ = table[key]
            bad.append((path, line, f"{path}:{line} {key[1]}: "
                        + ", ".join(f"{m}.{c}" for m, c in engine_bases)))
    return [text for _, _, text in sorted(bad)]


def find_function(text: str, cls: str, method: str) -> ast.FunctionDef | None:
    """The method ``cls.method`` defined in ``text`` (None when there is none)."""
    for node in ast.walk(parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and item.name == method:
                    return item
    return None


RUNG_CONCERNS = ("exclude", "max_new", "admit")


def schedule_signature_problems(fn: ast.FunctionDef, max_params: int = 1,
                                forbidden=RUNG_CONCERNS) -> list[str]:
    """What is wrong with ``fn``'s parameters (``self`` aside): more than ``max_params`` of them,
    or one named after a rung's concern."""
    a = fn.args
    params = [p for p in a.posonlyargs + a.args + a.kwonlyargs
              + ([a.vararg] if a.vararg else []) + ([a.kwarg] if a.kwarg else [])]
    if params and params[0].arg in ("self", "cls") and (a.posonlyargs + a.args)[:1] == params[:1]:
        params = params[1:]
    bad = []
    if len(params) > max_params:
        bad.append(f"line {fn.lineno}: {len(params)} parameters "
                   f"({', '.join(p.arg for p in params)}), at most {max_params}")
    bad += [f"line {p.lineno}: parameter {p.arg!r} is a rung's concern"
            for p in params if p.arg in forbidden]
    return bad
