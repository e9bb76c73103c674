"""What a teacher should look at in a student's file: near-copies of the reference, and lines that
reach into the machinery instead of computing (``lab check`` prints them; ``grade --class`` has a
column for them).

A copy is found on the whole file's syntax tree, the way MOSS finds one: the file is normalized
(every name of a variable, argument, function or class becomes ``_``; strings and numbers become
one placeholder each; docstrings, comments, layout, ``pass`` and no-op statements go), unparsed
and cut into tokens, and each run of ``K`` consecutive tokens is a fingerprint. The reference's
*answer* is the set of fingerprints of the reference that its skeleton (what every student is
given) does not have; the student's code is likewise the file's fingerprints the skeleton does
not have, wherever they are. The score is the share of the answer found in the student's code: a
body moved into a helper, renamed identifiers, reordered functions or added no-ops keep it near
1, since every run of ``K`` tokens inside a moved body survives. At ``COPY_AT`` or more, over an
answer long enough that an honest solution cannot be that close by chance (``MIN_GRAMS``), the
file is a copy and scores 0; ``why`` says how much of each function was found. The threshold was
set on honest solutions written from the hints and on disguised copies (docs/TEACHING.md has the
table; tests/lab/test_lab_isolation_copies.py keeps it true).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from .skeleton import _functions, make_skeleton

K = 10                   # tokens per fingerprint
COPY_AT = 0.7
MIN_GRAMS = 80           # below this, every correct solution looks alike: no verdict
# Names whose use in a solution means it reaches for the machinery (the grader, the import
# system, the caller's frames) rather than computing: listed for the teacher, with the line.
SUSPICIOUS = {
    "gc": r"\bgc\b", "_pytest": r"\b_?pytest\b", "importlib": r"\bimportlib\b|__import__",
    "sys._getframe": r"_getframe|\bf_back\b|\bf_locals\b|\binspect\b",
    "exec/eval": r"\b(exec|eval|compile)\s*\(", "meta_path": r"\bmeta_path\b|\bpath_hooks\b",
    "sys.modules": r"\bsys\.modules\b", "os._exit": r"\bos\._exit\b|\batexit\b",
    "faulthandler/signal": r"\bfaulthandler\b|\bsignal\b",
    "subprocess": r"\bsubprocess\b|\bos\.(system|popen|exec|spawn|fork)", "ctypes": r"\bctypes\b",
    "/proc": r"/proc\b|\bproc/", "git": r"\bgit\b|\.git\b",
    "os.link/dir_fd": r"\bos\.(link|symlink|open|rename|replace)\b|\bdir_fd\b",
}


class _Normalize(ast.NodeTransformer):
    """Names to ``_``, constants to placeholders, docstrings and no-ops out (module docstring)."""

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id="_", ctx=node.ctx), node)

    def visit_arg(self, node):
        node.arg, node.annotation = "_", None
        return node

    def visit_Constant(self, node):
        v = node.value
        keep = v is None or isinstance(v, bool) or v is Ellipsis
        return ast.copy_location(ast.Constant(v if keep else "" if isinstance(v, (str, bytes))
                                              else 0), node)

    def _named(self, node):
        node.name = "_"
        if hasattr(node, "returns"):
            node.returns = None
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _named

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                kept = [s for s in stmts if not _no_op(s)]
                setattr(node, field, kept or [ast.Pass()])
        return node


def _no_op(stmt: ast.stmt) -> bool:
    """``pass``, a lone constant (a docstring), ``_ = 0``, ``x = x``: statements that change
    nothing, added to dodge a copy check (seen after names became ``_``)."""
    if isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr)
                                      and isinstance(stmt.value, ast.Constant)):
        return True
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and isinstance(stmt.value, (ast.Constant, ast.Name)))


def tokens(node: ast.AST) -> list[str]:
    """``node`` normalized, unparsed and tokenized (newlines kept as ``;``, indentation not)."""
    text = ast.unparse(_Normalize().visit(ast.parse(ast.unparse(node))))
    skip = (tokenize.INDENT, tokenize.DEDENT, tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER)
    return [";" if t.type == tokenize.NEWLINE else t.string
            for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in skip]


def grams(toks: list[str]) -> set[tuple[str, ...]]:
    return {tuple(toks[i:i + K]) for i in range(max(0, len(toks) - K + 1))}


def copy_score(reference: str, student: str, functions: tuple[str, ...]) -> tuple[float, str]:
    """(the share of the reference's answer found in the student's file, 0..1, and the
    per-function detail); (0, "") where the answer is too short to tell (``MIN_GRAMS``)."""
    given = grams(tokens(ast.parse(make_skeleton(reference, functions, "x"))))
    answer = grams(tokens(ast.parse(reference))) - given
    if len(answer) < MIN_GRAMS:
        return 0.0, ""
    mine = grams(tokens(ast.parse(student))) - given
    defs = _functions(ast.parse(reference))
    parts = []
    for name in functions:
        own = grams(tokens(ast.Module(body=defs[name].body, type_ignores=[]))) & answer
        if own:
            parts.append(f"{name.rpartition('.')[2]} {len(own & mine) / len(own):.0%}")
    return len(answer & mine) / len(answer), ", ".join(parts)


def similarity(reference: str, student: str, functions: tuple[str, ...]) -> float:
    """``copy_score``'s share alone."""
    return copy_score(reference, student, functions)[0]


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
    """Everything ``lab check`` and the class table show about one file: ``copy`` (the share of
    the reference found, or None), ``why`` (how much of each function), ``lines`` (suspicious
    lines)."""
    text = path.read_text(encoding="utf-8")
    copy, why = None, ""
    if reference is not None and reference.exists():
        try:
            s, detail = copy_score(reference.read_text(encoding="utf-8"), text, functions)
        except (SyntaxError, KeyError, ValueError):
            s, detail = 0.0, ""
        if s >= COPY_AT:
            copy = s
            why = (f"{s:.0%} of the reference's answer is in the file (names, layout, helpers "
                   f"and order aside): {detail}")
    return {"copy": copy, "why": why, "lines": suspicious_lines(text)}
