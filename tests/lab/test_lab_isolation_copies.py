"""Copy detection that survives refactoring, calibrated: every disguised copy of every exercise's
reference is flagged (bodies moved into helpers, identifiers renamed, functions reordered, no-ops
added, all at once), and no honest solution written from the hints is.

    .venv/bin/python tests/lab/test_lab_isolation_copies.py     # prints the calibration table
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from minillm.lab import flags  # noqa: E402
from minillm.lab.exercises import EXERCISES  # noqa: E402
from minillm.lab.skeleton import _functions, make_skeleton  # noqa: E402
from test_lab_outside import HONEST_08  # noqa: E402


def _body(fn: ast.FunctionDef) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(the docstring statement or nothing, the rest of the body)."""
    b = fn.body
    doc = b[:1] if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant) else []
    return doc, b[len(doc):]


def helpers(source: str, functions: tuple[str, ...]) -> str:
    """Each exercised body moved into a module-level helper the function calls: the cheat that
    scored 0.10 under the old, per-function check."""
    tree = ast.parse(source)
    defs = _functions(tree)
    for i, name in enumerate(functions):
        fn = defs[name]
        doc, rest = _body(fn)
        helper = ast.FunctionDef(name=f"_part_{i}", args=fn.args, body=rest, decorator_list=[],
                                 returns=None, type_params=[])
        a = fn.args
        call = ast.Call(func=ast.Name(f"_part_{i}", ast.Load()),
                        args=[ast.Name(x.arg, ast.Load()) for x in a.posonlyargs + a.args]
                        + ([ast.Starred(ast.Name(a.vararg.arg, ast.Load()), ast.Load())]
                           if a.vararg else []),
                        keywords=[ast.keyword(x.arg, ast.Name(x.arg, ast.Load()))
                                  for x in a.kwonlyargs]
                        + ([ast.keyword(None, ast.Name(a.kwarg.arg, ast.Load()))]
                           if a.kwarg else []))
        fn.body = doc + [ast.Return(call)]
        tree.body.append(helper)
    return ast.unparse(ast.fix_missing_locations(tree))


def renamed(source: str, functions: tuple[str, ...]) -> str:
    """Every argument and local variable of the exercised functions renamed."""
    tree = ast.parse(source)
    for name in functions:
        fn = _functions(tree)[name]
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)} - {"self"}
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Store)}
        new = {old: f"v{i}_{old[::-1]}" for i, old in enumerate(sorted(local))}
        for n in ast.walk(fn):
            if isinstance(n, ast.Name) and n.id in new:
                n.id = new[n.id]
            elif isinstance(n, ast.arg) and n.arg in new:
                n.arg = new[n.arg]
    return ast.unparse(tree)


def reordered(source: str) -> str:
    """Top-level functions and every class's methods in the reverse order."""
    tree = ast.parse(source)
    for holder in [tree, *[n for n in tree.body if isinstance(n, ast.ClassDef)]]:
        slots = [i for i, n in enumerate(holder.body) if isinstance(n, ast.FunctionDef)]
        defs = [holder.body[i] for i in slots]
        for i, d in zip(slots, reversed(defs)):
            holder.body[i] = d
    return ast.unparse(tree)


def with_no_ops(source: str, functions: tuple[str, ...]) -> str:
    tree = ast.parse(source)
    for name in functions:
        fn = _functions(tree)[name]
        doc, rest = _body(fn)
        fn.body = doc + [s for stmt in rest for s in (ast.parse("_unused = 0").body[0], stmt)]
    return ast.unparse(ast.fix_missing_locations(tree))


DISGUISES = {
    "verbatim": lambda s, f: s,
    "helpers": helpers,
    "renamed": renamed,
    "reordered": lambda s, f: reordered(s),
    "no-ops": with_no_ops,
    "all at once": lambda s, f: reordered(renamed(helpers(with_no_ops(s, f), f),
                                                  f + tuple(f"_part_{i}" for i in range(len(f))))),
}

HONEST = {   # written from the hints, not from the reference: (exercise, {function: body})
    "08": HONEST_08,     # the class test grades it: it passes
    "12": {
        "TPOTController.observe": (
            "if not num_tokens > 0 or not math.isfinite(step_ms) or step_ms < 0:\n"
            "    return None\n"
            "x = (num_tokens, step_ms, num_tokens ** 2, num_tokens * step_ms)\n"
            "if self.moments is None:\n"
            "    self.moments = tuple(float(v) for v in x)\n"
            "else:\n"
            "    w = self.alpha\n"
            "    self.moments = tuple((1 - w) * old + w * v for old, v in zip(self.moments, x))\n"
            "self.fit = self._fit()\n"
            "before = self.cap\n"
            "after = self._cap()\n"
            "widen_by = max(1, before // 50)\n"
            "if after == before or (after > before and after - before <= widen_by):\n"
            "    return None\n"
            "self.cap = after\n"
            "a, b = self.fit\n"
            "return BatchDecision(before, after, step_ms, a, b)"),
        "TPOTController._fit": (
            "e_n, e_t, e_nn, e_nt = self.moments\n"
            "spread = e_nn - e_n ** 2\n"
            "if spread > 1:\n"
            "    slope = (e_nt - e_n * e_t) / spread\n"
            "    icept = e_t - slope * e_n\n"
            "    if slope > 0 and icept >= 0:\n"
            "        return icept, slope\n"
            "last_a = self.fit[0]\n"
            "icept = last_a if last_a < e_t else 0.0\n"
            "return icept, (e_t - icept) / e_n"),
        "TPOTController._cap": (
            "icept, slope = self.fit\n"
            "if slope <= 0:\n"
            "    return self.ceiling\n"
            "room = self.headroom * self.target_ms - icept\n"
            "n = math.floor(room / slope + 1e-9)\n"
            "return int(min(max(n, 1), self.ceiling))"),
    },
    "12-async": {
        "ThreadExecutor.submit": (
            "release_idle_openmp_threads()\n"
            "threads = torch.get_num_threads()\n"
            "future = self.worker.submit(self._on_worker, threads, fn, *args)\n"
            "return future"),
        "ThreadExecutor.wait": (
            "started = time.perf_counter()\n"
            "value, fwd = future.result()\n"
            "blocked = (time.perf_counter() - started) * 1000.0\n"
            "ov = self.overlap\n"
            "ov.steps += 1\n"
            "ov.forward_ms += fwd\n"
            "ov.waited_ms += blocked\n"
            "return value, fwd"),
        "ThreadExecutor.call": (
            "job = self.worker.submit(fn, *args)\n"
            "try:\n"
            "    return job.result()\n"
            "except KeyboardInterrupt:\n"
            "    wait([job])\n"
            "    raise"),
    },
    "06": {
        "accept_greedy": (
            "kept = []\n"
            "for i, d in enumerate(proposals):\n"
            "    best = target_argmax[i]\n"
            "    kept.append(best)\n"
            "    if best != d:\n"
            "        break\n"
            "else:\n"
            "    kept.append(target_argmax[len(proposals)])\n"
            "return kept"),
        "accept_seeded": (
            "kept = []\n"
            "i = 0\n"
            "while i <= len(proposals):\n"
            "    u = draw_uniform(p.seed, first_index + i, sample_id)\n"
            "    tok = sample_one(logits[i].float(), p.temperature, p.top_k, p.top_p, u)\n"
            "    kept.append(tok)\n"
            "    if i == len(proposals) or tok != proposals[i]:\n"
            "        break\n"
            "    i += 1\n"
            "return kept"),
        "accept_sampled": (
            "kept = []\n"
            "for i, d in enumerate(proposals):\n"
            "    probs = full_probs(logits[i], p)\n"
            "    if draft_probs is None:\n"
            "        qd = 1.0\n"
            "        q = torch.zeros_like(probs)\n"
            "        q[d] = 1.0\n"
            "    else:\n"
            "        q = draft_probs[i].to(probs.dtype)\n"
            "        qd = q[d].item()\n"
            "    ratio = probs[d].item() / qd\n"
            "    if spec_uniform(p.seed, first_index + i, 'accept') < min(1.0, ratio):\n"
            "        kept.append(d)\n"
            "        continue\n"
            "    left = torch.clamp(probs - q, min=0)\n"
            "    if left.sum().item() <= 0:\n"
            "        left = probs\n"
            "    kept.append(inverse_cdf(left, spec_uniform(p.seed, first_index + i, "
            "'resample')))\n"
            "    return kept\n"
            "u = draw_uniform(p.seed, first_index + len(proposals))\n"
            "kept.append(sample_one(logits[-1].float(), p.temperature, p.top_k, p.top_p, u))\n"
            "return kept"),
    },
}


def honest(ex_id: str) -> str:
    """The exercise's skeleton with the honest bodies written in."""
    ex = EXERCISES[ex_id]
    source = make_skeleton(ex.source_path.read_text(), ex.functions, ex.id, ex.hint)
    for name, body in HONEST[ex_id].items():
        stub = re.search(rf"\n( *)# TODO \(exercise {re.escape(ex_id)}\): write {re.escape(name)}"
                         rf"\.\n *raise NotImplementedError\(.*\)\n", source)
        code = "".join(f"{stub.group(1)}{line}\n" for line in body.splitlines())
        source = source[:stub.start() + 1] + code + source[stub.end():]
    ast.parse(source)
    return source


def scores() -> dict[str, dict[str, float]]:
    """exercise -> {disguise or "honest": score}."""
    out = {}
    for ex in EXERCISES.values():
        ref = ex.source_path.read_text()
        row = {d: flags.similarity(ref, make(ref, ex.functions), ex.functions)
               for d, make in DISGUISES.items()}
        if ex.id in HONEST:
            row["honest"] = flags.similarity(ref, honest(ex.id), ex.functions)
        out[ex.id] = row
    return out


def table(rows: dict[str, dict[str, float]]) -> str:
    cols = [*DISGUISES, "honest"]
    lines = [f"{'exercise':13s}" + "".join(f"{c:>12s}" for c in cols)]
    for ex_id, row in rows.items():
        lines.append(f"{ex_id:13s}" + "".join(f"{row[c]:12.2f}" if c in row else f"{'':12s}"
                                               for c in cols))
    return "\n".join(lines) + f"\n(flagged at {flags.COPY_AT}; 0.00 everywhere: the answer is " \
                              f"under {flags.MIN_GRAMS} fingerprints, too short to tell)"


@pytest.fixture(scope="module")
def calibration():
    return scores()


@pytest.mark.parametrize("ex_id", list(EXERCISES))
def test_every_disguised_copy_is_flagged(ex_id, calibration):
    row = calibration[ex_id]
    if row["verbatim"] == 0.0:
        pytest.skip(f"{ex_id}: the answer is too short to tell a copy from a solution")
    missed = {d: s for d, s in row.items() if d != "honest" and s < flags.COPY_AT}
    assert not missed, f"{ex_id}: disguised copies not flagged: {missed}"


@pytest.mark.parametrize("ex_id", list(HONEST))
def test_no_honest_solution_is_flagged_with_a_margin(ex_id, calibration):
    assert calibration[ex_id]["honest"] < flags.COPY_AT - 0.1, calibration[ex_id]


def test_the_review_says_why_a_file_is_flagged(tmp_path):
    ex = EXERCISES["12"]
    path = tmp_path / ex.file_name
    path.write_text(helpers(ex.source_path.read_text(), ex.functions))
    got = flags.review(ex.source_path, path, ex.functions)
    assert got["copy"] is not None and "of the reference's answer is in the file" in got["why"]
    assert "_fit 100%" in got["why"], got["why"]
    path.write_text(honest("12"))
    assert flags.review(ex.source_path, path, ex.functions)["copy"] is None


if __name__ == "__main__":
    print(table(scores()))
