"""The classroom labs: every grader passes the package's own code (the reference), fails the
empty skeleton with a message naming what to write, and fails a plausible wrong solution."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillm import lab
from minillm.lab.exercises import EXERCISES
from minillm.lab.grade import check, check_many, start
from minillm.lab.questions import QUESTIONS, blocks_independent_vs_shared
from minillm.lab.skeleton import make_skeleton
from labtools import assert_grader_judges, grade_sources

# One mistake students make, per exercise: (text in the reference, what they write instead).
WRONG = {
    # (Positions that count the padding are *not* a mistake the tokens can show: RoPE depends on
    # relative positions only, so a row shifted as a whole attends exactly as before.)
    "01": ("mask[i, width - len(s):] = 1", "mask[i, :] = 1"),    # padding not masked
    "02": ("        self.kv.select_rows(live)\n", ""),     # holes dropped from the rows only
    "03": ("return last.ref_count > 1 or last.hash is not None", "return False"),   # no CoW
    "03-scheduler": ("            self.allocator.free(seq)\n            seq.pending_logprobs = None",
                     "            seq.pending_logprobs = None"),   # preempted, blocks kept
    "04": ("attn_mask=bias, scale=scale)", "attn_mask=None, scale=scale)"),  # past context_lens
    "08": ("return victim.request.priority - candidate.request.priority > self.threshold",
           "return victim.request.priority - candidate.request.priority >= self.threshold"),
    "09": ("y = y.round_().clamp_(-fmt.qmax, fmt.qmax)", "y = y.clamp_(-fmt.qmax, fmt.qmax)"),
    "10": ("residual if self.adds_residual else None)", "residual)"),   # residual on every rank
    "11": ("return list(block_table[:-(-num_tokens // block_size)])",   # the partly filled
           "return list(block_table[:num_tokens // block_size])"),     # last block left behind
    "06": ("        out.append(target)\n        if guess != target:",
           "        out.append(guess)\n        if guess != target:"),    # the wrong guess kept
    "12": ("        if new == old or old < new <= old + max(1, old // 50):",
           "        if new == old:"),      # no hysteresis: the cap flips on measurement noise
    "12-async": (                         # the commit (the sampler) on the caller's thread
        "        done = self.worker.submit(fn, *args)\n",
        "        return fn(*args)\n        done = self.worker.submit(fn, *args)\n"),
}
# Exercise 06's sampled mistake: after a rejection, draw from p again instead of max(0, p - q)
WRONG_06_RESIDUAL = ("residual = (target - q).clamp_(min=0)", "residual = target.clone()")
# Exercise 06's seeded mistake: the uniform of the guess's place in this step, not of its output
# index (the tokens then depend on how the request's steps fell: the batch, the pool)
WRONG_06_SEEDED = ("draw_uniform(p.seed, first_index + j, sample_id)",
                   "draw_uniform(p.seed, j, sample_id)")
# More mistakes students make: each must fail its grader.
MORE_WRONG = {
    "03": [("return last.ref_count > 1 or last.hash is not None", "return last.ref_count > 1"),
           ("        if self._needs_cow(seq, num_new_tokens):\n            need += 1\n        return need",
            "        return need"),
           ("        for bid in reversed(seq.block_table):\n", "        for bid in seq.block_table:\n"),
           ("            self.free_queue[bid] = None     # most recently freed: evicted last",
            "            self.free_queue[bid] = None\n            self.free_queue.move_to_end(bid, "
            "last=False)")],
    "03-scheduler": [
        ("        self.waiting.insert(at, group)",      # preempted: to the back, whatever its rank
         "        self.waiting.append(group)"),
        ("victim = self._lowest_ranked(exclude)",
         "victim = next(g for g in self.running if g not in exclude)"),
        ("        self._readopt_prompt(group)\n        for seq in group.seqs:\n            num_new",
         "        for seq in group.seqs:\n            num_new")],
    "04": [("v.transpose(1, 2), attn_mask=bias, scale=scale)", "v.transpose(1, 2), attn_mask=bias)")],
    "09": [("            self.scale.index_copy_(0, index, scale)",      # a row's scale not written
            "            pass"),
           ("scale = self.scale.index_select(0, index) if",           # read at another slot
            "scale = self.scale.index_select(0, index.flip(0)) if")],
    "10": [("gate_up=Linear(torch.cat([gate[units], up[units]]), None, kernel)",   # one block of
            "gate_up=Linear(w.gate_up.weight[2 * units.start: 2 * units.stop], None, kernel)"),
           ("kv = range(rank // replicas, rank // replicas + 1)",               # KV head r % KVH
            "kv = range(rank % num_kv_heads, rank % num_kv_heads + 1)")],
    "11": [("return sum(self.num_blocks * shape.numel() * torch.empty(0, dtype=dtype).element_size()",
            "return sum(self.num_blocks * shape.numel()"),            # elements, not bytes
           ("    block_manager.cache_full_blocks(seq)\n    return blocks",   # no prefix cache
            "    return blocks"),
           ("        blocks = block_manager.allocate_loaded(seq, num_tokens)\n    except",
            "        blocks = block_manager.allocate_loaded(seq, num_tokens + 1)\n    except")],
    "12": [
        ("        a = self.fit[0] if self.fit[0] < mt else 0.0\n        return a, (mt - a) / mn",
         "        return 0.0, mt / mn"),                      # forgets a: "widen" swings
        ("        if new == old or old < new <= old + max(1, old // 50):\n            return None",
         "        new = max(1, old // 2) if t > self.target_ms else min(self.ceiling, old + 1)\n"
         "        if new == old:\n            return None"),              # AIMD: never settles
        ("return int(max(1, min(self.ceiling, math.floor((aim - a) / b + 1e-9))))",
         "return int(max(1, math.floor((aim - a) / b + 1e-9)))"),         # past the ceiling
        ("return int(max(1, min(self.ceiling, math.floor((aim - a) / b + 1e-9))))",
         "return int(min(self.ceiling, math.floor((aim - a) / b + 1e-9)))"),   # below 1
        ("        if var > 1.0:                     # at least a token of spread\n"
         "            b = (mnt - mn * mt) / var\n            a = mt - b * mn\n"
         "            if b > 0 and a >= 0:\n                return a, b\n"
         "        a = self.fit[0] if self.fit[0] < mt else 0.0\n"
         "        return a, (mt - a) / mn",                  # no fallback when n has no spread
         "        b = (mnt - mn * mt) / var\n        return mt - b * mn, b"),
        ("            self.moments = tuple(m + self.alpha * (x - m) for m, x in zip(self.moments, "
         "new))",                                           # a fit that never forgets
         "            self.count = getattr(self, 'count', 1) + 1\n            self.moments = "
         "tuple(m + (x - m) / self.count for m, x in zip(self.moments, new))")],
    "12-async": [
        ("        return self.worker.submit(self._on_worker, torch.get_num_threads(), fn, *args)",
         "        done = Future()\n        done.set_result(fn(*args))\n        return done"),
        ("        self.overlap.steps += 1\n", ""),          # the landed forward not counted
        ("        return self.worker.submit(self._on_worker, torch.get_num_threads(), fn, *args)",
         "        return self.worker.submit(fn, *args)")],   # the caller's thread count not set
}
WRONG_03_FREE = ("        if block.ref_count == 0:\n            self.free_queue[bid] = None",
                 "        self.free_queue[bid] = None")     # a shared block freed for everyone


def test_every_exercise_has_a_grader_and_a_wrong_solution():
    """Each exercise has its wrong solutions here, or in a test file of its own
    (``tests/lab/test_lab_exercises*.py`` names it)."""
    assert set(WRONG) <= set(EXERCISES)
    elsewhere = "".join(f.read_text() for f in Path(__file__).parent.glob("test_lab_exercises*.py"))
    for ex in EXERCISES.values():
        assert ex.grader.exists(), ex.grader
        if ex.id not in WRONG:
            assert f'"{ex.id}"' in elsewhere, f"{ex.id}: no wrong solution is tested"
            continue
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


def grade(ex, tmp_path, source: str, *extra: str, **options) -> subprocess.CompletedProcess:
    path = tmp_path / ex.id / ex.file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return check(ex, path, ("-x", *extra), capture=True, **options)


def mistakes(ex_id: str) -> list[tuple[str, str, str | None]]:
    """Every listed mistake of an exercise: (text in the reference, what is written instead,
    what the grader's message must say or None)."""
    found = [(*WRONG[ex_id], None)] + [(*m, None) for m in MORE_WRONG.get(ex_id, [])]
    if ex_id == "03":
        found.append((*WRONG_03_FREE, "free queue"))
    if ex_id == "06":
        found += [(*WRONG_06_RESIDUAL, "does not follow the target's distribution"),
                  (*WRONG_06_SEEDED, "plain decoding draws")]
    return found


# One test item per exercise: its files graded in one grading process (tests/labtools.py).
@pytest.mark.slow
@pytest.mark.parametrize("ex_id", [ex_id for ex_id in EXERCISES if ex_id in WRONG])
def test_grader_passes_the_reference_and_fails_skeleton_and_mistakes(ex_id, tmp_path):
    assert_grader_judges(ex_id, mistakes(ex_id), tmp_path)


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
    assert lab.is_right("00.q1", 32 * 2048 * kvb) is True
    assert lab.is_right("00.q1", 32 * 2048 * kvb / 2**30) is False          # GiB, not bytes
    assert lab.is_right("00.q1", 3e9) is False          # close is not right for a byte count
    assert lab.check("00.q1", 3e9) is None               # prints, returns nothing to display
    assert "✗ 00.q1: not yet (3000000000.0). Hint" in capsys.readouterr().out
    lab.check("00.q1", 32 * 2048 * kvb)
    assert capsys.readouterr().out == "✓ 00.q1: right.\n"
    assert lab.is_right("01.q3a", 2**30 // (2048 * kvb)) is True
    assert lab.is_right("01.q3b", "a lot") is False
    independent, shared = blocks_independent_vs_shared()
    assert shared < independent
    assert lab.is_right("03.q3", (independent, shared)) is True
    assert lab.is_right("03.q3", [independent, shared + 1]) is False
    with pytest.raises(KeyError, match="no question"):
        lab.check("9.q9", 1)


def test_question_truths_by_definition_equal_runs_of_the_package_s_code():
    """The truths that must not run exercised code (a handout's stubs) agree with a run of the
    package's own code, on the questions' numbers and on others (a partly filled block too)."""
    from minillm.lab import questions as q
    for args in ((), (70, 20, 3, 16), (5, 9, 2, 4), (64, 1, 4, 16)):
        assert q.blocks_by_definition(*args) == q.blocks_independent_vs_shared(*args), args
    for args in ((), (29, 3, 3, 4), (4, 8, 0, 4), (30, 8, 8, 4)):
        assert q.returned_by_definition(*args) == q.blocks_returned_after_rejection(*args), args
    for args in ((), (1, 1), (300, 2), (7, 0)):
        assert q.overtake_horizon_by_definition(*args) == q.score_overtake_horizon(*args), args


# --- grading a student cannot forge --------------------------------------------------------------
def skeleton(ex_id: str, tmp_path) -> str:
    return start(EXERCISES[ex_id], tmp_path / "fresh", force=True).read_text()


PATCH_REPORTS = """
import _pytest.reports as _r
_make = _r.TestReport.from_item_and_call.__func__
def _passed(cls, item, call):
    rep = _make(cls, item, call)
    rep.outcome, rep.longrepr = "passed", None
    return rep
_r.TestReport.from_item_and_call = classmethod(_passed)
"""
CHEATS = {   # run at the import of a blank skeleton of exercise 03: (code, the reason given)
    "os._exit(0) on import": ("import os\nos._exit(0)\n", "ended (exit code 0)"),
    "atexit: exit 0 after the failures": (
        "import atexit, os\natexit.register(lambda: os._exit(0))\n", "is not written yet"),
    "pytest's reports patched to passed": (PATCH_REPORTS, "is not written yet"),
}


@pytest.mark.slow
def test_generic_cheats_do_not_pass(tmp_path):
    """Each cheat after the ``__future__`` import of a blank skeleton, graded together."""
    head, sep, rest = skeleton("03", tmp_path).partition("from __future__ import annotations\n")
    graded = grade_sources("03", tmp_path, [head + sep + code + rest for code, _ in CHEATS.values()],
                           "-x")
    for cheat, done in zip(CHEATS, graded):
        assert done.returncode != 0, f"{cheat}: passed\n{done.stdout[-2000:]}"
        assert "verdict: not passed" in done.stdout and CHEATS[cheat][1] in done.stdout, \
            f"{cheat}:\n{done.stdout[-2000:]}"


@pytest.mark.slow
def test_replacing_what_graders_compare_with_does_not_pass(tmp_path):
    """Exercise 04 with the context_lens mistake and torch.allclose made to agree with anything."""
    ex = EXERCISES["04"]
    old, new = WRONG["04"]
    source = ex.source_path.read_text().replace(old, new)
    done = grade(ex, tmp_path, source + "\ntorch.allclose = lambda *a, **k: True\n")
    # judged in the grading process, whose torch.allclose the student's process cannot reach
    assert done.returncode != 0 and "decode differs" in done.stdout, done.stdout[-2000:]


@pytest.mark.slow
def test_the_package_s_own_code_is_not_a_solution(tmp_path):
    ex = EXERCISES["03"]
    cases = ((ex.source_path.read_text(), "near-copy"),                               # copied
             (f"exec(open({str(ex.source_path)!r}).read())\n", "package's own"))
    for (_, why), done in zip(cases, grade_sources("03", tmp_path, [c for c, _ in cases], "-x")):
        assert done.returncode != 0 and why in done.stdout, done.stdout[-2000:]


@pytest.mark.slow
def test_a_scheduler_that_never_preempts_stops_at_the_time_limit(tmp_path):
    ex = EXERCISES["03-scheduler"]
    old = """            while not self.allocator.can_append(seq, num_new):
                victim = self._lowest_ranked(exclude)
                self.preempt(victim, out)
                if victim is group:
                    return budget"""
    source = ex.source_path.read_text()
    assert old in source
    never = source.replace(old, """            if not self.allocator.can_append(seq, num_new):
                return budget""")
    done = grade(ex, tmp_path, never, test_limit_s=20)
    assert done.returncode != 0, done.stdout[-2000:]
    assert "did not finish" in done.stdout or "failed" in done.stdout, done.stdout[-2000:]


@pytest.mark.slow
def test_the_same_wrong_solution_gets_the_same_verdict_every_time(tmp_path):
    """Graded alone, then twice in one grading process (as a class is): nothing of one grading
    stays in the process to change the next one's verdict."""
    ex = EXERCISES["03"]
    alone = grade(ex, tmp_path, ex.source_path.read_text().replace(*WRONG["03"]))
    path = tmp_path / ex.id / ex.file_name
    runs = [alone, *check_many(ex, [path, path], ("-x",), capture=True)]
    verdicts = {done.stdout.rsplit("verdict:", 1)[1].strip() for done in runs}
    assert len(verdicts) == 1 and next(iter(verdicts)).startswith("not passed"), verdicts
    kinds = [(d.results[0], {n: k for n, (k, _) in d.results[1].items()}) for d in runs]
    assert kinds[0] == kinds[1] == kinds[2], kinds


def test_pytest_arguments_after_double_dash_wherever_it_falls(tmp_path, capsys):
    from minillm.lab.__main__ import main
    path = start(EXERCISES["03"], tmp_path)
    assert main(["check", "03", "--file", str(path), "--", "-x"]) == 1   # a blank skeleton
    out = capsys.readouterr().out
    assert "verdict: not passed" in out and "blocks_needed is not written yet" in out
    with pytest.raises(SystemExit):
        main(["list", "--", "-x"])


# --- teacher mode -------------------------------------------------------------------------------------
def solved(ex_id: str) -> str:
    """The reference's code with one harmless statement added: a near-copy (it scores 0 where
    the reference is at hand to compare with, i.e. not in a handout)."""
    source = EXERCISES[ex_id].source_path.read_text()
    assert "        # Tail first" in source
    return source.replace("        # Tail first", "        _ = 0\n        # Tail first", 1)


@pytest.mark.slow
def test_handout_has_no_solutions_and_its_check_uses_the_teacher_s_graders(tmp_path):
    from minillm.lab.grade import PACKAGE_ROOT
    from minillm.lab.skeleton import function_bodies
    from minillm.lab.teacher import handout
    out = handout(tmp_path / "students", list(EXERCISES))
    assert not (out / "minillm/lab/graders").exists() and not (out / "docs/ANSWERS.md").exists()
    assert not (out / "tests").exists() and not (out / ".git").exists()
    for ex in EXERCISES.values():
        ref = {k: v for k, v in function_bodies(ex.source_path.read_text(), ex.functions).items()
               if v.count("\n") >= 1}          # bodies of two statements or more
        for f in out.rglob("*.py"):
            mine = function_bodies(f.read_text(encoding="utf-8"), ex.functions)
            same = [k for k, v in ref.items() if mine.get(k) == v]
            assert not same, f"{f}: reference bodies of {same}"
    out = handout(tmp_path / "students-03", ["03", "08", "11"])     # three exercises to write
    env = {**os.environ, "PYTHONPATH": str(out)}
    run = lambda *a: subprocess.run([sys.executable, "-m", "minillm.lab", *a], cwd=out, env=env,
                                    capture_output=True, text=True)
    assert run("answers").returncode == 2
    # the key is not reachable through truth(); the questions about stubbed code still check
    py = lambda code: subprocess.run([sys.executable, "-c", code], cwd=out / "notebooks",
                                     env=env, capture_output=True, text=True)
    asked = py("from minillm import lab\nfrom minillm.lab.questions import QUESTIONS\n"
               "try:\n    QUESTIONS['09.q1'].truth()\nexcept PermissionError:\n"
               "    print('refused')\nfor q in ('03.q3', '06.q1', '08.q1'):\n    lab.check(q, 1)")
    assert asked.returncode == 0 and asked.stdout.count("not yet") == 3, asked.stderr[-2000:]
    assert "refused" in asked.stdout
    assert "has none" in run("check", "03").stderr + run("check", "03").stdout
    (out / "labwork" / "03").mkdir(parents=True)
    (out / "labwork" / "03" / "block_manager.py").write_text(solved("03"))
    # a notebook's first cell (run in notebooks/): the solution stands in for the stub, the
    # unsolved exercises are named
    nb = py("from minillm.lab import labwork\nused = labwork.use()\n"
            "from minillm.core.block_manager import BlockManager\n"
            "print(sorted(used), BlockManager(4, 4).blocks_needed.__code__.co_filename)")
    assert nb.returncode == 0, nb.stderr[-2000:]
    assert "['minillm.core.block_manager']" in nb.stdout and "labwork/03" in nb.stdout
    assert "exercise 08 is yours to write" in nb.stdout and "exercise 11" in nb.stdout
    graded = run("check", "03", "--graders", str(PACKAGE_ROOT / "minillm/lab/graders"))
    assert graded.returncode == 0, graded.stdout[-2000:] + graded.stderr[-2000:]
