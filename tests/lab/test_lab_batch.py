"""Several files graded in one grading process (``check_many``, as ``grade --class`` grades an
exercise): each file gets its own output, results and verdict — the ones ``check`` gives it alone
— and a file that ends the grading process, or runs past its time, leaves the files after it to
a new process. A small grader of its own (``GRADER``) keeps these fast: its tests read what the
student's module says and judge it, kept at module level as real graders keep answers (which a
grading process that kept the grader's modules from one file to the next would judge the next
file by)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from minillm.lab.exercises import EXERCISES
from minillm.lab.grade import check, check_many, start

pytestmark = pytest.mark.slow
EX = EXERCISES["01"]          # any exercise: the grader below replaces its own

GRADER = '''
import time

OUTSIDE = True        # the student's module computes in the student's process


def probe_answer() -> tuple:
    from minillm.engines import padded
    return getattr(padded, "ANSWER", None), getattr(padded, "SLEEP", 0)


_GOT: dict = {}     # asked once per session and kept, as graders do: never for another student


def answer(student) -> tuple:
    if "answer" not in _GOT:
        _GOT["answer"] = student.run(probe_answer)
    return _GOT["answer"]


def test_the_answer(student):
    got, sleep = answer(student)
    time.sleep(sleep)         # here, in the grading process: past a limit when asked to
    assert got == "right", f"the module answers {got}"


def test_the_answer_again(student):
    assert answer(student)[0] == "right"
'''


def write_graders(folder: Path) -> Path:
    folder.mkdir()
    (folder / EX.grader.name).write_text(GRADER)
    shutil.copyfile(EX.grader.with_name("conftest.py"), folder / "conftest.py")
    return folder


@pytest.fixture
def graders(tmp_path):
    return write_graders(tmp_path / "graders")


def files(tmp_path, *tails: str) -> list:
    """The exercise's skeleton (not a near-copy of the reference) with ``tail`` appended, one
    file each."""
    out = []
    for i, tail in enumerate(tails):
        path = start(EX, tmp_path / f"s{i}")
        path.write_text(path.read_text() + "\n" + tail + "\n")
        out.append(path)
    return out


def test_each_file_gets_its_own_output_and_the_verdict_it_gets_alone(tmp_path, graders):
    paths = files(tmp_path, "ANSWER = 'right'", "ANSWER = 'AAA'", "ANSWER = 'BBB'",
                  "def broken(:", "ANSWER = 'right'")
    ended = []
    done = check_many(EX, paths, capture=True, graders=graders, on_graded=ended.append)
    assert [d.returncode for d in done] == [0, 1, 1, 1, 0]
    assert ended == [0, 1, 2, 4], "one progress call per file graded, in order"
    assert "AAA" in done[1].stdout and "BBB" not in done[1].stdout, done[1].stdout
    assert "BBB" in done[2].stdout and "AAA" not in done[2].stdout, done[2].stdout
    assert "syntax error, line" in done[3].stdout and done[3].results == ([], {})
    for d in (done[0], done[4]):
        assert "AAA" not in d.stdout and "BBB" not in d.stdout and "verdict: passed" in d.stdout
    collected, outcomes = done[1].results
    assert len(collected) == 2 and {k for k, _ in outcomes.values()} == {"failed"}
    alone = check(EX, paths[1], capture=True, graders=graders)
    assert alone.results == done[1].results and alone.returncode == 1


LIMIT_S = 60      # 5x what a loaded 2-core machine needs for a file that passes here


@pytest.fixture(scope="module")
def past_limits(tmp_path_factory) -> dict:
    """The two limits, each graded by ``check_many`` in a thread of its own at the same time:
    each waits out its limit with the CPU idle, which one after the other held a test worker for
    two minutes. ``test limit``: the second file's test sleeps past the test limit, and
    ``faulthandler`` ends the grading process in it. ``time limit``: the first file sleeps past
    the file's own time limit and is stopped, the process with it."""
    tmp = tmp_path_factory.mktemp("limits")
    graders = write_graders(tmp / "graders")
    calls = {"test limit": (files(tmp / "t", "ANSWER = 'right'", "ANSWER = 'right'\nSLEEP = 600",
                                  "ANSWER = 'right'"), {"test_limit_s": LIMIT_S}),
             "time limit": (files(tmp / "f", "ANSWER = 'right'\nSLEEP = 600", "ANSWER = 'right'"),
                            {"timeout": LIMIT_S})}
    t = time.monotonic()
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {k: pool.submit(check_many, EX, paths, capture=True, graders=graders, **kw)
                   for k, (paths, kw) in calls.items()}
        done = {k: f.result() for k, f in futures.items()}
    return {**done, "took_s": time.monotonic() - t}


@pytest.mark.xdist_group("lab-batch-limits")      # one worker runs the fixture, once
def test_a_file_that_ends_the_grading_process_leaves_the_rest_to_a_new_one(past_limits):
    """The third file is graded by a new process, as it would be alone."""
    done = past_limits["test limit"]
    assert [d.returncode for d in done] == [0, 1, 0], [d.stdout[-800:] for d in done]
    collected, outcomes = done[1].results
    assert len(collected) == 2 and not outcomes, "the test past its limit has no outcome"
    assert "did not finish" in done[1].stdout, done[1].stdout[-2000:]


@pytest.mark.xdist_group("lab-batch-limits")
def test_a_file_past_its_time_is_stopped_and_the_next_still_graded(past_limits):
    """Each file's ``timeout`` counts from its own start: the second is graded by a new process."""
    done = past_limits["time limit"]
    assert [d.returncode for d in done] == [1, 0], [d.stdout[-800:] for d in done]
    assert f"ran past its time limit ({LIMIT_S} s)" in done[0].stdout, done[0].stdout[-2000:]
    assert past_limits["took_s"] < 600, "the sleeping file was not stopped at its limit"


def running(marker: bytes) -> list[str]:
    """The processes whose command line holds ``marker`` (the grading's folders are in them)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_during_a_class_ends_it_leaving_nothing(tmp_path):
    """SIGINT to ``lab grade --class`` once the first student is graded: it exits with 130 and a
    line saying so, no process of the grading is left, and its temporary folders are gone."""
    cls = tmp_path / "class"
    for name in ("ann", "bob", "cat"):
        path = start(EX, cls / name)
        path.write_text(path.read_text() + "\nimport time\ntime.sleep(600)\n" * (name != "ann"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "MINILLM_LAB_IMPORT_LIMIT_S": "300"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm.lab", "grade", "--class", str(cls),
                             "--exercises", EX.id, "--out", str(tmp_path / "grades"),
                             "--allow-unisolated"], env=env, cwd=Path(__file__).parents[2],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a background job's SIGINT is ignored: the CLI's must not be
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:                 # ann's verdict, then bob's hangs at import
            if "ann: exercise" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted: `lab grade` stopped" in err, err[-2000:]
    assert not (tmp_path / "grades.csv").exists()
    assert not running(str(tmp).encode()), "a process of the grading left running"
    assert list(tmp.iterdir()) == [], "a temporary folder left behind"
