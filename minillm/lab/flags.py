"""What a teacher should look at in a student's file: near-copies of the reference, and lines that
reach into the machinery instead of computing (``lab check`` prints them; ``grade --class`` has a
column for them).

A copy is found on the syntax tree, not the text: each exercised function's statements (docstring
left out) become a sequence of node kinds with identifiers and constants normalized away, so
renaming variables, re-wrapping lines, editing comments or adding a no-op statement per function
leave it nearly unchanged. The student's sequence is compared with the reference's
(``difflib``'s ratio); at ``COPY_AT`` or more, over enough code that an honest solution cannot be
that close by chance (``MIN_NODES``), the file is a copy and scores 0.
"""
from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

from .skeleton import _functions

COPY_AT = 0.9
MIN_NODES = 60           # below this, every correct solution looks alike: no verdict
# Names whose use in a solution means it reaches for the machinery (the grader, the import
# system, the caller's frames) rather than computing: listed for the teacher, with the line.
SUSPICIOUS = {
    "gc": r"\bgc\b", "_pytest": r"\b_?pytest\b", "importlib": r"\bimportlib\b|__import__",
    "sys._getframe": r"_getframe|\bf_back\b|\bf_locals\b|\binspect\b",
    "exec/eval": r"\b(exec|eval|compile)\s*\(", "meta_path": r"\bmeta_path\b|\bpath_hooks\b",
    "sys.modules": r"\bsys\.modules\b", "os._exit": r"\bos\._exit\b|\batexit\b",
    "faulthandler/signal": r"\bfaulthandler\b|\bsignal\b",
}


def _normalized(node: ast.AST) -> list[str]:
    """Node kinds in walk order; names, attributes and constants reduced to their kind, so that
    only the shape of the code is compared."""
    out = []
    for n in ast.walk(node):
        kind = type(n).__name__
        if isinstance(n, ast.BinOp | ast.UnaryOp | ast.BoolOp | ast.AugAssign):
            kind += ":" + type(n.op).__name__
        elif isinstance(n, ast.Compare):
            kind += ":" + ",".join(type(o).__name__ for o in n.ops)
        elif isinstance(n, ast.Attribute):
            kind += ":" + n.attr        # the API called is part of the shape, the names are not
        out.append(kind)
    return out


def _shape(source: str, functions: tuple[str, ...]) -> list[str]:
    defs = _functions(ast.parse(source))
    seq: list[str] = []
    for name in functions:
        body = list(defs[name].body) if name in defs else []
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]                                  # the docstring is given
        body = [s for s in body if not isinstance(s, ast.Pass)
                and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        seq.append(f"def {name}")
        for stmt in body:
            if not _no_op(stmt):
                seq += _normalized(stmt)
    return seq


def _no_op(stmt: ast.stmt) -> bool:
    """``_ = 0``, ``x = x``: statements that change nothing, added to dodge a copy check."""
    if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
        return all(isinstance(t, ast.Name) and t.id.startswith("_") for t in stmt.targets)
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and ast.dump(stmt.targets[0]) == ast.dump(stmt.value).replace("Load", "Store"))


def similarity(reference: str, student: str, functions: tuple[str, ...]) -> float:
    """How alike the exercised functions are, 0..1, by shape (see the module docstring); 0 where
    the reference's functions are too short to tell a copy from a solution."""
    ref = _shape(reference, functions)
    if len(ref) - len(functions) < MIN_NODES:
        return 0.0
    mine = _shape(student, functions)
    return difflib.SequenceMatcher(None, ref, mine, autojunk=False).ratio()


def suspicious_lines(source: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for each line naming the machinery (``SUSPICIOUS``); comments
    and strings of a line count too: a path built at run time hides in strings."""
    found = []
    for i, line in enumerate(source.splitlines(), 1):
        for what, pattern in SUSPICIOUS.items():
            if re.search(pattern, line):
                found.append((i, what, line.strip()[:120]))
                break
    return found


def syntax_error(path: Path) -> str | None:
    """"syntax error, line N: …" if the file does not parse (compiled, never run)."""
    try:
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
    except SyntaxError as e:
        return f"syntax error, line {e.lineno}: {e.msg}"
    except (UnicodeDecodeError, ValueError) as e:
        return f"the file cannot be read as Python source: {e}"
    return None


def review(reference: Path | None, path: Path, functions: tuple[str, ...]) -> dict:
    """Everything ``lab check`` and the class table show about one file: ``copy`` (similarity, or
    None), ``lines`` (suspicious lines)."""
    text = path.read_text(encoding="utf-8")
    copy = None
    if reference is not None and reference.exists():
        try:
            s = similarity(reference.read_text(encoding="utf-8"), text, functions)
        except (SyntaxError, KeyError):
            s = 0.0
        copy = s if s >= COPY_AT else None
    return {"copy": copy, "lines": suspicious_lines(text)}
