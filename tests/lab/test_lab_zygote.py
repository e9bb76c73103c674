"""The students' zygote (minillm/lab/zygote.py): each student's process is a fork of one jail that
imported torch once, and is walled off from the students forked before and after it — no other
tree, a fresh ``/tmp``, nothing left running, no descriptor of the zygote's, ``nobody`` — and
the zygote dies with the grading process that started it. The walls a jail of its own has are
checked for both kinds of process in test_lab_isolation.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from minillm.lab.exercises import EXERCISES
from minillm.lab.jail import isolation

pytestmark = pytest.mark.skipif("not isolation()[0]", reason="no namespaces on this machine")
EX = EXERCISES["08"]


def look(write: str, marker: str) -> dict:
    """What a student's process sees of the machine, after leaving ``write`` in ``/tmp`` and a
    process named ``marker`` running in a session of its own."""
    import os
    seen = {"trees": os.listdir("/trees"), "tmp": sorted(os.listdir("/tmp")),
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
            "uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
            "caps": [line.split()[1] for line in open("/proc/self/status")
                     if line.startswith(("CapEff", "CapPrm"))]}
    open(f"/tmp/{write}", "w").close()
    if os.fork() == 0:
        os.setsid()
        os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 600", marker])
    return seen


def running(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return True
        except OSError:
            pass
    return False


def wait_until(condition, tries: int = 300) -> bool:
    for _ in range(tries):           # bounded: a namespace's processes die as it ends
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def exits(code: int) -> None:
    import os
    os._exit(code)


@pytest.fixture
def students(monkeypatch):
    from minillm.lab.sandbox import Student
    monkeypatch.setenv("MINILLM_LAB_ZYGOTE", "on")
    made = [Student({EX.module: EX.source_path}, limit_s=120) for _ in range(2)]
    yield made
    for s in made:
        s.close()


def test_each_fork_is_walled_off_from_the_others(students):
    """Two students of one zygote at once: neither sees a tree (its own is at /lab), a file or a
    process of the other's; each holds only its three pipes (and the listing's own descriptor),
    as ``nobody`` with no capability; what one leaves running ends with it, not with the other."""
    a, b = students
    assert a.zygote is b.zygote and a.zygote is not None
    marks = [f"minillm-zygote-watcher-{name}-{os.getpid()}" for name in "ab"]
    for s, name, mark in zip(students, "ab", marks):
        seen = s.run(look, f"from-{name}", mark)
        assert seen["trees"] == [] and seen["tmp"] == []
        assert seen["fds"] == [0, 1, 2, 3], "a descriptor of the zygote's was left open"
        assert seen["pids"] == [1, 2], "a process outside its own namespace is visible"
        assert seen["caps"] == ["0000000000000000"] * 2
        if os.geteuid() == 0:
            assert seen["uid"] == 65534
    assert wait_until(lambda: all(running(m) for m in marks)), "a watcher did not start"
    a.close()
    assert wait_until(lambda: not running(marks[0])), "a's watcher outlived a's process"
    assert running(marks[1]), "b's watcher died with a's process"
    b.close()
    assert wait_until(lambda: not running(marks[1]))


def test_a_process_that_ended_reports_its_own_exit_code(students):
    """Killed after it ended (as ``Student`` kills every process it is done with), a fork reports
    the code it ended with, as ``Popen.wait`` does: the verdict names it."""
    from minillm.lab.sandbox import StudentError
    with pytest.raises(StudentError, match=r"ended \(exit code 7\)"):
        students[0].run(exits, 7)


CHILD = """
import os
from minillm.lab.exercises import EXERCISES
from minillm.lab.sandbox import Student

def one():
    return 1

if __name__ == "__main__":      # (this file is the probe's too: the student's process loads it)
    s = Student({EXERCISES["08"].module: EXERCISES["08"].source_path}, limit_s=60)
    assert s.run(one) == 1
    print(s.zygote.proc.pid, s.zygote.home, flush=True)
    os.kill(os.getpid(), 9)     # no atexit, no cleanup: the kernel must end the zygote
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"     # a zombie has ended
    except OSError:
        return True


def test_the_zygote_dies_with_its_grading_process(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    done = subprocess.run([sys.executable, str(tmp_path / "child.py")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "MINILLM_LAB_ZYGOTE": "on"})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    pid, home = done.stdout.split()
    shutil.rmtree(home, ignore_errors=True)   # what a killed grading leaves in its TMPDIR
    for _ in range(300):                      # bounded: the death signal is sent at once
        if _gone(int(pid)):
            break
        time.sleep(0.1)
    assert _gone(int(pid)), "the zygote outlived the grading process that started it"


def limits() -> tuple:
    import resource
    return resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_FSIZE)


def test_each_fork_takes_the_limits_of_its_own_start(students, monkeypatch):
    """The limits are read when each student's process starts (``MINILLM_LAB_LIMIT_*``), not
    when the zygote did."""
    first = students[0].run(limits)
    monkeypatch.setenv("MINILLM_LAB_LIMIT_FILES", "77")
    monkeypatch.setenv("MINILLM_LAB_LIMIT_FILE_MB", "3")
    second = students[1].run(limits)
    assert first[0][0] != 77 and second == ((77, 77), (3 << 20, 3 << 20))
