"""The classroom labs: every grader passes the package's own code (the reference), fails the
empty skeleton with a message naming what to write, and fails a plausible wrong solution."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from minillm import lab
from minillm.lab.exercises import EXERCISES
from minillm.lab.grade import check, start
from minillm.lab.questions import QUESTIONS, blocks_independent_vs_shared
from minillm.lab.skeleton import make_skeleton

# One mistake students make, per exercise: (text in the reference, what they write instead).
WRONG = {
    # (Positions that count the padding are *not* a mistake the tokens can show: RoPE depends on
    # relative positions only, so a row shifted as a whole attends exactly as before.)
    "01": ("mask[i, width - len(s):] = 1", "mask[i, :] = 1"),    # padding not masked
    "02": ("        self.kv.select_rows(live)\n", ""),     # holes dropped from the rows only
    "03": ("return last.ref_count > 1 or last.hash is not None", "return False"),   # no CoW
    "03-scheduler": ("            self.bm.free(seq)\n            seq.pending_logprobs = None",
                     "            seq.pending_logprobs = None"),   # preempted, blocks kept
    "04": ("attn_mask=bias, scale=scale)", "attn_mask=None, scale=scale)"),  # past context_lens
    "08": ("return victim.request.priority - candidate.request.priority > self.threshold",
           "return victim.request.priority - candidate.request.priority >= self.threshold"),
    "06": ("        out.append(target)\n        if guess != target:",
           "        out.append(guess)\n        if guess != target:"),    # the wrong guess kept
}
# Exercise 06's sampled mistake: after a rejection, draw from p again instead of max(0, p - q)
WRONG_06_RESIDUAL = ("residual = (target - q).clamp_(min=0)", "residual = target.clone()")
# Exercise 06's seeded mistake: the uniform of the guess's place in this step, not of its output
# index (the tokens then depend on how the request's steps fell: the batch, the pool)
WRONG_06_SEEDED = ("draw_uniform(p.seed, first_index + j, sample_id)",
                   "draw_uniform(p.seed, j, sample_id)")
WRONG_03_FREE = ("        if block.ref_count == 0:\n            self.free_queue[bid] = None",
                 "        self.free_queue[bid] = None")     # a shared block freed for everyone


def test_every_exercise_has_a_grader_and_a_wrong_solution():
    assert set(WRONG) == set(EXERCISES)
    for ex in EXERCISES.values():
        assert ex.grader.exists(), ex.grader
        source = ex.source_path.read_text()
        assert WRONG[ex.id][0] in source, f"{ex.id}: the wrong-solution patch no longer applies"


@pytest.mark.parametrize("ex_id", list(EXERCISES))
def test_skeleton_keeps_everything_but_the_bodies(ex_id):
    ex = EXERCISES[ex_id]
    source = ex.source_path.read_text()
    skeleton = make_skeleton(source, ex.functions, ex.id, ex.hint)
    orig, skel = ast.parse(source), ast.parse(skeleton)
    assert ast.get_docstring(orig) == ast.get_docstring(skel)

    def defs(tree):
        out = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, ast.FunctionDef):
                        out[f"{node.name}.{f.name}"] = f
        for f in tree.body:
            if isinstance(f, ast.FunctionDef):
                out[f.name] = f
        return out
    a, b = defs(orig), defs(skel)
    assert a.keys() == b.keys()
    for name in a:
        if name in ex.functions:
            assert ast.get_docstring(a[name]) == ast.get_docstring(b[name])
            assert ast.dump(a[name].args) == ast.dump(b[name].args), "signature changed"
            assert "NotImplementedError" in ast.unparse(b[name])
        else:
            assert ast.dump(a[name]) == ast.dump(b[name]), f"{name} must be left untouched"


def grade(ex, tmp_path, source: str, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / ex.id / ex.file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return check(ex, path, ("-x", *extra), capture=True)


@pytest.mark.slow
@pytest.mark.parametrize("ex_id", list(EXERCISES))
def test_grader_passes_the_reference_and_fails_skeleton_and_mistake(ex_id, tmp_path):
    ex = EXERCISES[ex_id]
    source = ex.source_path.read_text()
    ok = grade(ex, tmp_path, source)               # a student who writes the reference's code
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    stub = start(ex, tmp_path / "student")
    empty = check(ex, stub, ("-x",), capture=True)
    assert empty.returncode != 0
    assert "is not written yet" in empty.stdout, empty.stdout[-2000:]
    old, new = WRONG[ex_id]
    wrong = grade(ex, tmp_path, source.replace(old, new))
    assert wrong.returncode != 0, f"{ex_id}: the grader accepts a wrong solution"
    if ex_id == "03":
        wrong = grade(ex, tmp_path, source.replace(*WRONG_03_FREE))
        assert wrong.returncode != 0, "03: the grader accepts freeing a shared block"
        assert "free queue" in wrong.stdout, wrong.stdout[-2000:]
    if ex_id == "06":
        wrong = grade(ex, tmp_path, source.replace(*WRONG_06_RESIDUAL))
        assert wrong.returncode != 0, "06: the grader accepts resampling from p after a rejection"
        assert "does not follow the target's distribution" in wrong.stdout, wrong.stdout[-2000:]
        assert WRONG_06_SEEDED[0] in source
        wrong = grade(ex, tmp_path, source.replace(*WRONG_06_SEEDED))
        assert wrong.returncode != 0, "06: the grader accepts a uniform that is not the index's"
        assert "plain decoding draws" in wrong.stdout, wrong.stdout[-2000:]


def test_start_never_overwrites_a_students_work(tmp_path):
    ex = EXERCISES["03"]
    path = start(ex, tmp_path)
    path.write_text("# my work")
    with pytest.raises(SystemExit, match="already exists"):
        start(ex, tmp_path)
    assert path.read_text() == "# my work"
    start(ex, tmp_path, force=True)
    assert "TODO (exercise 03)" in path.read_text()


def test_cli_lists_and_refuses_unknown_exercises():
    r = subprocess.run([sys.executable, "-m", "minillm.lab", "list"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and all(e in r.stdout for e in EXERCISES)
    r = subprocess.run([sys.executable, "-m", "minillm.lab", "check", "99"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "no exercise '99'" in r.stderr


@pytest.mark.slow
def test_questions_check_answers_computed_from_the_engine(smol, capsys):
    kvb = smol.kv_bytes_per_token
    assert QUESTIONS["00.q1"].truth() == 32 * 2048 * kvb
    assert lab.check("00.q1", 32 * 2048 * kvb) is True
    assert lab.check("00.q1", 32 * 2048 * kvb / 2**30) is False          # GiB, not bytes
    assert "Hint" in capsys.readouterr().out
    assert lab.check("01.q3a", 2**30 // (2048 * kvb)) is True
    assert lab.check("01.q3b", "a lot") is False
    independent, shared = blocks_independent_vs_shared()
    assert shared < independent
    assert lab.check("03.q3", (independent, shared)) is True
    assert lab.check("03.q3", [independent, shared + 1]) is False
    with pytest.raises(KeyError, match="no question"):
        lab.check("9.q9", 1)
