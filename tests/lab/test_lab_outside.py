"""The student's code computes in its own process, the grader judges in the teacher's.

Each kind of cheat a student may try (on exercises 06, 08 and 09) is rejected with its reason;
each wrong solution a looser grader passes, or that ends in a raw error, fails the test
written for it with a message naming the mistake; the ranks exercises 10 and 11 spawn run the
student's file; a correct solution written differently from the reference passes, in a class
of six graded in one command."""
from __future__ import annotations

import re

import pytest

from minillm.lab.exercises import EXERCISES
from minillm.lab.grade import check, start
from minillm.lab.sandbox import PACKAGE
from labtools import grade_sources

pytestmark = pytest.mark.slow


def reference(ex_id: str) -> str:
    return EXERCISES[ex_id].source_path.read_text()


def skeleton(ex_id: str, tmp_path) -> str:
    return start(EXERCISES[ex_id], tmp_path / "fresh", force=True).read_text()


def after_future(source: str, code: str) -> str:
    """``code`` inserted after the module's ``from __future__`` line (it must come first)."""
    head, sep, rest = source.partition("from __future__ import annotations\n")
    return head + sep + code + rest


def grade(ex_id: str, tmp_path, source: str, *pytest_args: str):
    ex = EXERCISES[ex_id]
    path = tmp_path / ex_id / ex.file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return check(ex, path, pytest_args, capture=True)


def outcome(done, test: str) -> str:
    """The outcome of the grader's test whose id contains ``test``."""
    collected, outcomes = done.results
    hits = [outcomes.get(n, ("not run",))[0] for n in collected if test in n]
    assert hits, f"no test {test} in {collected}"
    return "failed" if "failed" in hits else hits[0]


def load_teacher(ex_id: str) -> str:
    """Code that loads the teacher's own module with a path built at run time."""
    rel = EXERCISES[ex_id].source_path.relative_to(PACKAGE).as_posix()
    # Split at the separators so that no literal path appears, whatever the checkout's path is
    # (a split inside a directory name fails on some checkouts, CI's /check/... for one).
    parts = [*PACKAGE.as_posix().split("/"), *rel.split("/")]
    return ("import importlib.util as _u\n"
            f"_path = '/'.join({parts!r})\n"
            "_spec = _u.spec_from_file_location('_ref', _path)\n"
            "_ref = _u.module_from_spec(_spec)\n_spec.loader.exec_module(_ref)\n")


def bind_reference(ex_id: str) -> str:
    """Module-end code making every exercised function the loaded reference's."""
    return "".join(f"\n{f} = _ref.{f}\n" for f in EXERCISES[ex_id].functions)


CHEATS = {   # kind -> (exercise, source builder, what the reason must say)
    "importlib on the package's file": (
        "06", lambda t: after_future(skeleton("06", t), load_teacher("06")) + bind_reference("06"),
        "PermissionError"),
    "importlib on the package's file, exercise 03": (
        "03", lambda t: after_future(skeleton("03", t), load_teacher("03"))
        + "\nBlockManager = _ref.BlockManager\n", "PermissionError"),
    "importlib on the package's file, exercise 10 (ranks spawned)": (
        "10", lambda t: after_future(skeleton("10", t), load_teacher("10")) + bind_reference("10"),
        "PermissionError"),
    "importlib on the package's file, exercise 11 (workers spawned)": (
        "11", lambda t: after_future(skeleton("11", t), load_teacher("11")) + bind_reference("11"),
        "PermissionError"),
    "exec of its source, path built at run time": (
        "08", lambda t: after_future(skeleton("08", t), load_teacher("08").replace(
            "_spec.loader.exec_module(_ref)", "exec(open(_path).read(), _ref.__dict__)"))
        + bind_reference("08"), "PermissionError"),
    "sys.modules[__name__] swapped": (
        "09", lambda t: skeleton("09", t) + "\n" + load_teacher("09")
        + "import sys\nsys.modules[__name__] = _ref\n", "PermissionError"),
    "the reference only under a test_* frame": (
        "06", lambda t: skeleton("06", t) + "\nimport sys\n"
        "_f = sys._getframe(0)\nwhile _f is not None and not _f.f_code.co_name.startswith('test_'):\n"
        "    _f = _f.f_back\nif _f is not None:\n    " + load_teacher("06").replace("\n", "\n    ")
        + bind_reference("06").replace("\n", "\n    "), "not written yet"),
    "pytest's Function.runtest patched": (
        "09", lambda t: skeleton("09", t) + "\ntry:\n    import _pytest.python as _p\n"
        "    _p.Function.runtest = lambda self: None\nexcept ImportError:\n    pass\n",
        "not written yet"),
    "the Recorder found with gc": (
        "06", lambda t: skeleton("06", t) + "\nimport gc\nfor _o in gc.get_objects():\n"
        "    if type(_o).__name__ == 'Recorder':\n        _o._write('passed', 'x')\n",
        "not written yet"),
    "a passed line signed, then os._exit(0)": (
        "08", lambda t: after_future(skeleton("08", t), "import os\nos._exit(0)\n"),
        "ended (exit code 0)"),
}


@pytest.mark.parametrize("ex_id", sorted({ex_id for ex_id, _, _ in CHEATS.values()}))
def test_each_cheat_is_rejected_with_its_reason(ex_id, tmp_path):
    """The cheats on one exercise graded together, as a class is (the first failure says why)."""
    kinds = [k for k, (e, _, _) in CHEATS.items() if e == ex_id]
    graded = grade_sources(ex_id, tmp_path, [CHEATS[k][1](tmp_path) for k in kinds], "-x")
    for kind, done in zip(kinds, graded):
        assert done.returncode != 0, f"{kind} passed exercise {ex_id}:\n{done.stdout[-3000:]}"
        assert CHEATS[kind][2] in done.stdout, f"{kind}:\n{done.stdout[-3000:]}"


def test_suspicious_lines_are_listed_and_a_syntax_error_names_its_line(tmp_path):
    from minillm.lab.flags import suspicious_lines
    lines = suspicious_lines("x = 1\nimport gc\nsys.modules['a'] = 1\nf = sys._getframe(1)\n")
    assert [(n, what) for n, what, _ in lines] == [(2, "gc"), (3, "sys.modules"),
                                                   (4, "sys._getframe")]
    done = grade("08", tmp_path, reference("08") + "\ndef broken(:\n")
    assert done.returncode != 0 and done.results == ([], {})
    assert "syntax error, line" in done.stdout, done.stdout


HOLES_08 = {   # wrong solutions of exercise 08 that a grader must not pass
    "remaining from the first sample":
        ("max((len(s.output_token_ids) for s in group.seqs), default=0)",
         "len(group.seqs[0].output_token_ids)"),
    "remaining from the slowest sample":
        ("max((len(s.output_token_ids) for s in group.seqs), default=0)",
         "min((len(s.output_token_ids) for s in group.seqs), default=0)"),
    "finished samples counted":
        ("for s in group.seqs), default=0)", "for s in group.seqs + group.done_seqs), default=0)"),
    "the prompt not subtracted":
        ("max((len(s.output_token_ids) for s in group.seqs), default=0)",
         "max((len(s.token_ids) for s in group.seqs), default=0)"),
    "a score without the remaining term":
        ("                + self.remaining_weight * remaining_tokens(group)\n", ""),
    "aging by arrival_index": ("self.wait_weight * group.arrival_step",
                               "self.wait_weight * group.arrival_index"),
    "Score.preempts with >=": ("self.score(victim) - self.score(candidate) > self.margin",
                               "self.score(victim) - self.score(candidate) >= self.margin"),
}


def test_wrong_policies_the_old_grader_passed_now_fail(tmp_path):
    for hole, (old, new) in HOLES_08.items():
        assert old in reference("08"), f"{hole}: the mistake no longer applies"
    graded = grade_sources("08", tmp_path, [reference("08").replace(old, new, 1)
                                         for old, new in HOLES_08.values()],
                        "-k", "strict_preemption")
    for hole, done in zip(HOLES_08, graded):
        assert outcome(done, "test_remaining_score_and_strict_preemption") == "failed", \
            f"{hole}:\n{done.stdout[-3000:]}"


def test_one_scale_per_token_across_kv_heads_fails(tmp_path):
    """09: a scale per token shared by its KV heads (a test with one KV head cannot tell)."""
    old = "amax = xf.abs().amax(dim=-1)"
    new = "amax = xf.abs().amax(dim=-1).amax(dim=-1, keepdim=True).expand(xf.shape[:-1])"
    assert old in reference("09")
    done = grade("09", tmp_path, reference("09").replace(old, new), "-k", "int8")
    assert outcome(done, "test_int8_one_scale_per_row") == "failed", done.stdout[-3000:]


NAMED = {   # wrong solutions that a grader could pass or meet with a raw error: (exercise, edits,
    # the grader's test that must fail, what its message must say)
    "03: free keeps the computed counts": (
        "03", [("        seq.block_table = []\n        seq.num_computed_tokens = seq.num_cached_tokens = 0",
                "        seq.block_table = []")], "free_forgets", "free must set both to 0"),
    "08: preempts' arguments swapped": (
        "08", [("return victim.request.priority - candidate.request.priority > self.threshold",
                "return candidate.request.priority - victim.request.priority > self.threshold"),
               ("return self.score(victim) - self.score(candidate) > self.margin",
                "return self.score(candidate) - self.score(victim) > self.margin")],
        "strict_preemption", "the arguments swapped?"),
    "10: o cut along the wrong dimension": (
        "10", [("o=Linear(w.o.weight[:, cols].contiguous(), None, kernel)",
                "o=Linear(w.o.weight[cols].contiguous(), None, kernel)")],
        "summed_slices", "o is row-parallel"),
    "11: a room check by floor division": (
        "11", [("    try:\n        blocks = block_manager.allocate_loaded(seq, num_tokens)\n"
                "    except NoFreeBlocksError:\n        return None\n",
                "    if block_manager.num_free_blocks < num_tokens // block_manager.block_size:\n"
                "        return None\n    blocks = block_manager.allocate_loaded(seq, num_tokens)\n")],
        "no_room", "9 tokens need 3 blocks and 2 are free: install_blocks returns None"),
}


@pytest.mark.parametrize("mistake", list(NAMED))
def test_mistakes_fail_with_a_message_naming_them(mistake, tmp_path):
    ex_id, edits, test, message = NAMED[mistake]
    source = reference(ex_id)
    for old, new in edits:
        assert old in source, f"{mistake}: the mistake no longer applies"
        source = source.replace(old, new)
    done = grade(ex_id, tmp_path, source, "-k", test)
    assert outcome(done, test) == "failed", done.stdout[-3000:]
    assert message in done.stdout, done.stdout[-3000:]


HONEST_08 = {   # exercise 08 written differently from the reference (same behaviour)
    "Priority.key": "return group.request.priority, group.arrival_index",
    "Priority.preempts": "gap = victim.request.priority - candidate.request.priority\n"
                         "return gap > self.threshold",
    "remaining_tokens": "most = 0\nfor s in group.seqs:\n    most = max(most, s.num_tokens - "
                        "s.prompt_len)\nreturn max(group.request.params.max_tokens - most, 0)",
    "Score.score": "p = self.priority_weight * group.request.priority\n"
                   "r = self.remaining_weight * remaining_tokens(group)\n"
                   "return p + r + self.wait_weight * group.arrival_step",
    "Score.preempts": "return self.score(victim) - self.score(candidate) > self.margin",
}


def honest(ex_id: str, bodies: dict, tmp_path) -> str:
    source = skeleton(ex_id, tmp_path)
    for name, body in bodies.items():
        stub = re.search(rf"\n( *)raise NotImplementedError\(\"exercise {ex_id}: {re.escape(name)} "
                         r"is not written yet\"\)\n", source)
        indent = stub.group(1)
        code = "".join(f"{indent}{line}\n" for line in body.splitlines())
        source = source[:stub.start() + 1] + code + source[stub.end():]
    return source


def test_a_class_in_one_command(tmp_path, capsys):
    """Six students, one command: a solution written differently from the reference (it passes,
    nothing to review), a cheat, a hole, a copy disguised (each body moved into a helper, names
    changed, functions reordered: flagged, with why), a file that does not parse and nobody's
    file; the CSV (with its isolation column) and JUnit reports."""
    from test_lab_isolation_copies import DISGUISES
    import csv
    import time
    import xml.etree.ElementTree as ET

    from minillm.lab.teacher import grade_class, table
    ex = EXERCISES["08"]
    cheats = after_future(skeleton("08", tmp_path), load_teacher("08")) + bind_reference("08")
    sources = {
        "ann": honest("08", HONEST_08, tmp_path),                               # correct
        "bob": after_future(cheats, "import os\nos._exit(0)\n"),                # cheats
        "cat": honest("08", HONEST_08 | {"remaining_tokens": "return group.request.params."
                      "max_tokens - len(group.seqs[0].output_token_ids)"}, tmp_path),  # a hole
        "eve": DISGUISES["all at once"](reference("08"), ex.functions),        # a copy
        # os._exit before the __future__ import: refused before any process starts
        "fay": "import os\nos._exit(0)\n" + skeleton("08", tmp_path),
    }
    cls = tmp_path / "class"
    for name, text in sources.items():
        (cls / name / "08").mkdir(parents=True)
        (cls / name / "08" / ex.file_name).write_text(text)
    (cls / "gus").mkdir()                                       # handed in nothing
    t = time.perf_counter()
    from minillm.lab.jail import isolation
    isolated = isolation()[0]
    grades = grade_class(cls, ["08"], tmp_path / "grades", progress=lambda *_: None,
                         allow_unisolated=not isolated)
    per_student = (time.perf_counter() - t) / (len(sources) - 1)   # fay's never ran
    by = {g.student: g for g in grades}
    assert not by["fay"].passed and by["fay"].points == 0 and "syntax error, line" in by["fay"].reason
    assert not by["gus"].passed and by["gus"].reason == f"no 08/{ex.file_name}"
    rows = list(csv.DictReader(open(tmp_path / "grades.csv")))
    assert {r["isolated"] for r in rows} == {"yes" if isolated else "no"}
    assert [(r["student"], r["passed"], r["copy"]) for r in rows] == [
        ("ann", "1", "0"), ("bob", "0", "0"), ("cat", "0", "0"), ("eve", "0", "1"),
        ("fay", "0", "0"), ("gus", "0", "0")]
    suites = ET.parse(tmp_path / "grades.xml").getroot()
    assert [s.get("name") for s in suites] == ["ann", "bob", "cat", "eve", "fay", "gus"]
    assert [s.get("failures") for s in suites] == ["0", "1", "1", "1", "1", "1"]
    assert by["ann"].passed and by["ann"].points == 1.0
    assert by["ann"].tests_run == by["ann"].tests_total >= 14
    assert not by["ann"].copy and not by["ann"].review     # written differently: nothing to read
    assert by["bob"].points == 0 and "ended" in by["bob"].reason and by["bob"].review
    g = by["cat"]
    assert not g.passed and g.tests_run == g.tests_total and 0 < g.points < 1, g
    assert "strict_preemption" in g.reason
    assert by["eve"].points == 0 and by["eve"].copy and "near-copy" in by["eve"].reason
    assert "of the reference's answer is in the file" in by["eve"].copy_why
    assert by["eve"].tests_run == by["eve"].tests_total, "a copy is still graded in full"
    text = table(grades)
    assert "✓ 1.00 14/14" in text and "copy: " in text and "[os._exit]" in text
    with capsys.disabled():
        print(f"\n{text}\n(grading took {per_student:.0f} s per student on this machine)")


SPAWNED_RANK_FAILS = '''
import os as _os
_FIRST = _os.environ.setdefault("MINILLM_TEST_FIRST_PID", str(_os.getpid()))
_{f} = {f}


def {f}(*args, **kwargs):
    if str(_os.getpid()) != _FIRST:      # a process started by the one that imported this first
        raise RuntimeError("a spawned rank ran the student's {f}")
    return _{f}(*args, **kwargs)
'''


@pytest.mark.parametrize("ex_id, function, test", [("10", "shard_layer", "T_ranks"),
                                                   ("11", "filled_blocks", "disagg_engine")])
def test_spawned_ranks_run_the_student_s_file(ex_id, function, test, tmp_path):
    """The package's own code, except that ``function`` fails in any process but the first: the
    multi-process engine test must fail, which it does only if the ranks it spawns (10: ranks
    1..T-1; 11: the prefill worker) load the student's file, not the package's."""
    ex = EXERCISES[ex_id]
    path = tmp_path / ex_id / ex.file_name
    path.parent.mkdir(parents=True)
    path.write_text(reference(ex_id) + SPAWNED_RANK_FAILS.format(f=function))
    # the default limit: on a loaded machine the T=4 ranks (each importing torch) took over 120 s
    done = check(ex, path, ("-k", test), capture=True)
    assert outcome(done, test) == "failed", done.stdout[-3000:]
    assert "worker rank 1 (pid" in done.stdout and "exited with code 1" in done.stdout, \
        done.stdout[-3000:]        # the spawned rank raised: its exit ends the run


PROBES = '''
import os


def ok():
    return 2


def die():
    os._exit(5)
'''


def test_a_process_that_ends_at_import_is_started_once_and_one_that_ends_in_a_call_again(
        tmp_path):
    """A file that ends its process while it is imported would end every restart: the calls after
    the first fail at once, with the same reason. One that ends it in a call is started again for
    the next call."""
    import importlib.util

    from minillm.lab.sandbox import Student, StudentError
    (tmp_path / "probes.py").write_text(PROBES)
    spec = importlib.util.spec_from_file_location("probes", tmp_path / "probes.py")
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)
    ex = EXERCISES["03"]
    ends = tmp_path / "ends.py"
    ends.write_text("import os\nos._exit(3)\n")
    student = Student({ex.module: ends}, limit_s=120)
    starts, start = [], student._start         # (an isolated process cannot write out: counted here)
    student._start = lambda: (starts.append(1), start())
    try:
        for _ in range(3):
            with pytest.raises(StudentError, match=r"ended \(exit code 3\) while importing"):
                student.run(probes.ok)
        assert len(starts) == 1, "started again after it ended at import"
    finally:
        student.close()
    student = Student({ex.module: ex.source_path}, limit_s=120)
    try:
        with pytest.raises(StudentError, match=r"ended \(exit code 5\) before it answered"):
            student.run(probes.die)
        assert student.run(probes.ok) == 2
    finally:
        student.close()


CONFIG_PROBE = '''
OUTSIDE = True   # judges nothing of the student's: it reports the grading process's own pytest


def test_the_grading_s_own_configuration(request):
    config = request.config
    names = {name for name, _ in config.pluginmanager.list_name_plugin()}
    assert not names & {"hypothesispytest", "xdist", "timeout", "anyio", "platformdirs"}, names
    assert config.inipath is not None and config.inipath.name == "pytest.ini", config.inipath
    assert not [m for m in config.getini("markers") if m.startswith("mine")]
'''


def test_a_grading_loads_no_plugin_and_no_pyproject_settings(tmp_path):
    """The grading process autoloads no pytest plugin (pytest would rewrite the asserts of every
    module of each plugin's package, with no bytecode written: ~3 s of every grading) and reads an
    empty pytest.ini of its own, not the settings of a pyproject.toml above the grader (a
    handout's is the students' to edit; the project's names pytest-timeout's options)."""
    graders = tmp_path / "graders"
    graders.mkdir()
    (graders / "pyproject.toml").write_text('[tool.pytest.ini_options]\nmarkers = ["mine: x"]\n'
                                            'addopts = "-p no:python"\n')
    ex = EXERCISES["03"]
    (graders / ex.grader.name).write_text(CONFIG_PROBE)
    done = check(ex, None, (), capture=True, graders=graders)
    assert outcome(done, "own_configuration") == "passed", done.stdout[-3000:]
    assert "PytestConfigWarning" not in done.stdout, done.stdout[-3000:]
