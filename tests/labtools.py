"""Grading an exercise's listed mistakes, shared by the lab's tests (``tests/lab``)."""
from __future__ import annotations

from pathlib import Path

from minillm.lab.exercises import EXERCISES
from minillm.lab.grade import check_many, start


def assert_grader_judges(ex_id: str, mistakes: list[tuple[str, str, str | None]],
                         tmp_path: Path) -> None:
    """The grader of ``ex_id`` passes the package's own code, fails the skeleton naming what to
    write, and fails each mistake — (text of the reference, what is written instead, what the
    verdict must say or None) — all graded in one grading process (``check_many``: its start-up
    paid once, each file with a student process of its own), as ``grade --class`` grades."""
    ex = EXERCISES[ex_id]
    source = ex.source_path.read_text()
    for old, new, _ in mistakes:
        assert old in source, f"{ex_id}: the mistake {new!r} no longer applies"
    ok, empty, *wrong = grade_sources(ex_id, tmp_path, [
        None, start(ex, tmp_path / "student").read_text(),
        *(source.replace(old, new) for old, new, _ in mistakes)], "-x")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    assert empty.returncode != 0 and "is not written yet" in empty.stdout, empty.stdout[-2000:]
    for (_, new, message), done in zip(mistakes, wrong):
        assert done.returncode != 0, f"{ex_id}: the grader accepts {new!r}"
        if message is not None:
            assert message in done.stdout, f"{ex_id}, {new!r}:\n{done.stdout[-2500:]}"


def grade_sources(ex_id: str, tmp_path: Path, sources: list[str | None],
                  *pytest_args: str) -> list:
    """Each of ``sources`` written as a student's file of ``ex_id`` (None: the package's own code)
    and all graded in one grading process (``check_many``), in order."""
    ex = EXERCISES[ex_id]
    paths = []
    for i, source in enumerate(sources):
        if source is None:                      # the package's own code: the reference
            paths.append(None)
            continue
        paths.append(tmp_path / f"{ex_id}-{i}" / ex.file_name)
        paths[-1].parent.mkdir(parents=True)
        paths[-1].write_text(source)
    return check_many(ex, paths, pytest_args, capture=True)
