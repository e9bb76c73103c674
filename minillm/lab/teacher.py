"""Teacher mode: grade a class, and hand students a copy without the solutions (docs/TEACHING.md).

    python -m minillm.lab grade --class submissions/        # one folder per student
    python -m minillm.lab handout ../student-repo           # the students' repository

``grade_class`` grades every student's files with this copy's graders and reference modules —
each exercise on its own, the student's file standing in for its module; one grading process per
exercise for the whole class, a student process per student — and writes a table,
a CSV and a JUnit XML: per student and exercise, the verdict, the tests passed out of the
grader's tests (the points) and the reason. A student's folder is laid out as ``lab start``
writes it (``alice/03/block_manager.py``). ``handout`` writes the repository students get: the
files git tracks, no history, the exercised functions' bodies replaced by the skeleton's stubs,
and neither graders, tests nor answer key.
"""
from __future__ import annotations

import csv
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from .exercises import EXERCISES, Exercise
from . import jail
from .grade import PACKAGE_ROOT, check_many
from .skeleton import make_skeleton

# Teacher-only files: never in a handout (the graders are the hidden tests; the key is the key).
WITHHELD = ("minillm/lab/graders/", "tests/", "docs/ANSWERS.md", ".ci/")


@dataclass
class Grade:
    student: str
    exercise: str
    passed: bool
    tests_passed: int
    tests_total: int
    reason: str
    tests_run: int = 0
    copy: bool = False          # a near-copy of the reference (flags.py): 0 points
    review: tuple = ()          # (line, what, text) a teacher should read (flags.py)
    isolated: bool = False      # whether the student's process ran isolated (jail.py)
    copy_why: str = ""          # why it is a copy (flags.review)

    @property
    def points(self) -> float:
        """1 for a passed exercise; 0 for a copy, or where not every test of the grader ran (the
        grader could not judge it all); else the share of the grader's tests that passed."""
        if self.passed:
            return 1.0
        if self.copy or self.tests_run < self.tests_total:
            return 0.0
        return self.tests_passed / max(1, self.tests_total)


def graded(student: str, ex: Exercise, done: subprocess.CompletedProcess) -> Grade:
    """The row of ``student`` on ``ex`` from its ``check`` result."""
    if done.tampered:
        raise SystemExit(f"grading stopped at exercise {ex.id} ({student} or a student graded "
                         f"with them): the teacher's files changed during it "
                         f"({', '.join(done.tampered[:3])}); restore them (git status) before "
                         "grading again, and read those students' files")
    reason = done.stdout.rsplit("verdict:", 1)[-1].strip()
    collected, outcomes = done.results if isinstance(done.results, tuple) else ([], {})
    ok = sum(1 for n in collected if outcomes.get(n, ("",))[0] == "passed")
    ran = sum(1 for n in collected if n in outcomes)
    return Grade(student, ex.id, done.returncode == 0, ok, len(collected), reason, ran,
                 done.review["copy"] is not None, tuple(done.review["lines"]), done.isolated[0],
                 done.review.get("why", ""))


def grade_exercise(ex: Exercise, folders: list[Path], limit_s: int,
                   progress=print) -> dict[str, Grade]:
    """Every student's file for ``ex`` graded in one grading process (``check_many``), each
    with a student process of its own; a missing file gets its row without a grading."""
    rows = {f.name: Grade(f.name, ex.id, False, 0, 0, f"no {ex.id}/{ex.file_name}",
                          isolated=jail.isolation()[0])
            for f in folders if not (f / ex.id / ex.file_name).exists()}
    handed = [f for f in folders if f.name not in rows]
    progress(f"exercise {ex.id}: grading {len(handed)} of {len(folders)} students…")
    if handed:
        count = iter(range(1, len(handed) + 1))
        done = check_many(ex, [f / ex.id / ex.file_name for f in handed], capture=True,
                          timeout=limit_s, on_graded=lambda i: progress(
                              f"  [{next(count)}/{len(handed)}] {handed[i].name}: exercise "
                              f"{ex.id} graded"))
        rows |= {f.name: graded(f.name, ex, d) for f, d in zip(handed, done)}
    return rows


def grade_class(class_dir: Path, exercises: list[str], out: Path, limit_s: int = 1200,
                progress=print, allow_unisolated: bool = False) -> list[Grade]:
    """Grade every student folder of ``class_dir`` on ``exercises``; write ``out``.csv and
    ``out``.xml (JUnit) and return the grades. Refused where the students' code cannot run
    isolated (``jail.isolation``) unless ``allow_unisolated``: every row then says so."""
    isolated, why = jail.isolation()
    if not isolated and not allow_unisolated:
        raise SystemExit(f"this machine cannot isolate the students' code ({why}): a student's "
                         "process could read the reference and the grader, or write them. Grade "
                         "on Linux with user namespaces, or pass --allow-unisolated to grade "
                         "anyway (every row then says isolated: no)")
    students = sorted(p for p in Path(class_dir).iterdir() if p.is_dir())
    if not students:
        raise SystemExit(f"{class_dir} has no student folders (one folder per student, laid "
                         "out as `lab start` writes: NAME/03/block_manager.py)")
    by_exercise = {e: grade_exercise(EXERCISES[e], students, limit_s, progress) for e in exercises}
    grades = [by_exercise[e][folder.name] for folder in students for e in exercises]
    write_csv(grades, out.with_suffix(".csv"))
    write_junit(grades, out.with_suffix(".xml"))
    return grades


def write_csv(grades: list[Grade], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "exercise", "passed", "tests_passed", "tests_run", "tests_total",
                    "points", "copy", "isolated", "review", "reason"])
        for g in grades:
            w.writerow([g.student, g.exercise, int(g.passed), g.tests_passed, g.tests_run,
                        g.tests_total, f"{g.points:.2f}", int(g.copy),
                        "yes" if g.isolated else "no", review_text(g), g.reason])


def review_text(g: Grade) -> str:
    """Why it is a copy, then the lines to read, ``line N [what]``, joined (empty when there is
    nothing to read)."""
    return "; ".join(([f"copy: {g.copy_why}"] if g.copy else [])
                     + [f"line {n} [{what}]" for n, what, _ in g.review])


def write_junit(grades: list[Grade], path: Path) -> None:
    suites = ET.Element("testsuites")
    for student in dict.fromkeys(g.student for g in grades):
        mine = [g for g in grades if g.student == student]
        suite = ET.SubElement(suites, "testsuite", name=student, tests=str(len(mine)),
                              failures=str(sum(not g.passed for g in mine)))
        for g in mine:
            case = ET.SubElement(suite, "testcase", classname=student, name=f"exercise {g.exercise}")
            ET.SubElement(case, "properties").append(ET.Element(
                "property", name="points", value=f"{g.points:.2f}"))
            if not g.passed:
                ET.SubElement(case, "failure", message=g.reason[:500])
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def cell(g: Grade) -> str:
    """``✓ 1.00 14/14``: the verdict, the points, tests run / tests the grader has (``copy``
    instead of the counts for a near-copy of the reference)."""
    mark = "✓" if g.passed else "✗"
    return f"{mark} {g.points:.2f} " + ("copy" if g.copy else f"{g.tests_run}/{g.tests_total}")


def table(grades: list[Grade]) -> str:
    """One row per student, a column per exercise (points, tests run / the grader's tests), the
    total, a review column (lines a teacher should read), and the summary; the reasons below."""
    exercises = list(dict.fromkeys(g.exercise for g in grades))
    rows = [f"{'student':16s}" + "".join(f"{e:>18s}" for e in exercises)
            + f"{'total':>8s}  isolated  review"]
    for student in dict.fromkeys(g.student for g in grades):
        mine = {g.exercise: g for g in grades if g.student == student}
        flagged = [f"{e}: {review_text(mine[e])}" for e in exercises if review_text(mine[e])]
        isolated = "yes" if all(g.isolated for g in mine.values()) else "no"
        rows.append(f"{student:16s}" + "".join(f"{cell(mine[e]):>18s}" for e in exercises)
                    + f"{sum(g.points for g in mine.values()):>8.2f}  {isolated:8s}  "
                    + " | ".join(flagged))
    passed = {e: sum(g.passed for g in grades if g.exercise == e) for e in exercises}
    n = len(rows) - 1
    rows.append("passed: " + ", ".join(f"{e} {k}/{n}" for e, k in passed.items()))
    rows += [f"  {g.student} {g.exercise}: {' '.join(g.reason.split())[:160]}"   # one line each
             for g in grades if not g.passed]
    return "\n".join(rows)


def handout(out: Path, exercises: list[str], with_graders: bool = False) -> Path:
    """Write the students' repository into ``out`` (which must not exist yet); ``with_graders``:
    also the graders, in ``lab-graders/`` (outside the package, so the copy is still a handout:
    no key), for students to run ``lab check`` themselves — they then see the tests."""
    out = Path(out)
    if out.exists():
        raise SystemExit(f"{out} already exists: give a new folder")
    listed = subprocess.run(["git", "ls-files"], cwd=PACKAGE_ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        raise SystemExit(f"handout copies the files git tracks: {PACKAGE_ROOT} is not a git "
                         f"checkout of minillm ({listed.stderr.strip()})")
    files = listed.stdout.splitlines()
    stubbed: dict[str, list[Exercise]] = {}      # a module may hold several exercises
    for e in exercises:
        ex = EXERCISES[e]
        stubbed.setdefault(ex.source_path.relative_to(PACKAGE_ROOT).as_posix(), []).append(ex)
    for rel in files:
        if rel.startswith(WITHHELD):
            continue
        src, dst = PACKAGE_ROOT / rel, out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel in stubbed:
            text = src.read_text(encoding="utf-8")
            for ex in stubbed[rel]:
                text = make_skeleton(text, ex.functions, ex.id, ex.hint, header=False)
            dst.write_text(text, encoding="utf-8")
        elif src.is_file():
            shutil.copy2(src, dst)
    if with_graders:
        from .grade import SHIPPED_GRADERS
        shutil.copytree(PACKAGE_ROOT / "minillm/lab/graders", out / SHIPPED_GRADERS,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return out
