"""Turn a module of the engine into a student's skeleton: the named functions lose their bodies.

Everything else stays byte for byte (imports, classes, the other methods, comments), and each
emptied function keeps its signature and docstring, followed by a ``TODO`` comment and a
``NotImplementedError`` that says which exercise it belongs to. Done on the syntax tree, so a
function is found by its qualified name (``BlockManager.append_slots``), never by text matching.
"""
from __future__ import annotations

import ast
import textwrap


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Qualified name -> definition, for module-level functions and methods of top-level classes."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = item
    return found


def make_skeleton(source: str, functions: tuple[str, ...], exercise_id: str, hint: str = "",
                  header: bool = True) -> str:
    """``source`` with the bodies of ``functions`` replaced (see the module docstring); with
    ``header``, a comment on top saying what to do (``lab start``; a handout's modules have none)."""
    tree = ast.parse(source)
    defs = _functions(tree)
    missing = [f for f in functions if f not in defs]
    if missing:
        raise ValueError(f"exercise {exercise_id}: no function {', '.join(missing)} in the module")
    lines = source.splitlines(keepends=True)
    # Replace from the bottom up so earlier line numbers stay valid.
    for name in sorted(functions, key=lambda f: defs[f].lineno, reverse=True):
        node = defs[name]
        body = node.body
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        first = body[1] if has_doc and len(body) > 1 else (None if has_doc else body[0])
        start = (first.lineno if first is not None else body[0].end_lineno + 1) - 1
        end = body[-1].end_lineno
        indent = " " * (body[0].col_offset)
        stub = [f"{indent}# TODO (exercise {exercise_id}): write {name}.\n",
                f"{indent}raise NotImplementedError(\"exercise {exercise_id}: {name} is not "
                f"written yet\")\n"]
        if first is None:         # only a docstring: the stub goes after it
            start = end
        lines[start:end] = stub
    if not header:
        return "".join(lines)
    top = [f"minillm lab, exercise {exercise_id}: write the functions marked TODO, then run",
           f"    python -m minillm.lab check {exercise_id}"]
    if hint:
        top += textwrap.wrap(f"Hint: {hint}", 96)
    return "".join(f"# {h}\n" for h in top) + "".join(lines)


def function_bodies(source: str, functions: tuple[str, ...]) -> dict[str, str]:
    """Each named function's statements, docstring left out, as a syntax-tree dump (comments and
    layout do not count): how ``lab check`` tells a copy of the reference from a solution."""
    defs = _functions(ast.parse(source))
    out = {}
    for name in functions:
        body = defs[name].body if name in defs else []
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        out[name] = "\n".join(ast.dump(stmt) for stmt in body)
    return out
