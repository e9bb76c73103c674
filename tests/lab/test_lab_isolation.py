"""The student's process, isolated: each escape a student found is planted and meets a wall, and
each way to stall or flood the grading is judged within a bound, leaving nothing behind.

The escapes run as code in a student's process (``attempt``, a probe of this file, computes there)
and report what they reached; ``test_lab_isolation_grading.py`` plants the same ones in students'
files graded end to end. Without namespaces (macOS, a locked container) the isolated tests are
skipped and the fallback's are not: ``MINILLM_LAB_ISOLATION=off`` forces it here."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "minillm" / "engines" / "r8_policies" / "policy.py"


def attempt(code: str):
    """Run ``code`` in the student's process: its ``result``, or the exception it raised."""
    ns: dict = {}
    try:
        exec(code, ns)
    except BaseException as e:      # noqa: BLE001 - what stopped it is the answer
        return f"{type(e).__name__}: {e}"
    return ns.get("result")


def ok():
    return 2


def _isolated() -> bool:
    from minillm.lab.jail import isolation
    return isolation()[0]


needs_isolation = pytest.mark.skipif("not _isolated()", reason="no namespaces on this machine")


@pytest.fixture(scope="module", params=["zygote", "own jail"])
def student(request):
    """A student's process forked by the grading's zygote (minillm/lab/zygote.py), and one
    started in a jail of its own (``MINILLM_LAB_ZYGOTE=off``): every wall holds in both."""
    from minillm.lab.exercises import EXERCISES
    from minillm.lab.sandbox import Student
    from minillm.lab.zygote import ENV
    if not _isolated():
        pytest.skip("no namespaces on this machine")
    os.environ["AWS_SECRET_ACCESS_KEY"] = "teacher-secret"        # the grader's environment
    os.environ[ENV] = "on" if request.param == "zygote" else "off"
    s = Student({EXERCISES["08"].module: EXERCISES["08"].source_path}, limit_s=120)
    assert (s.zygote is not None) == (request.param == "zygote")
    try:
        yield s
    finally:
        s.close()
        os.environ.pop("AWS_SECRET_ACCESS_KEY")
        os.environ.pop(ENV)


LIBC = "import ctypes, os\nlibc = ctypes.CDLL('libc.so.6', use_errno=True)\n"
GRADER = REPO / "minillm" / "lab" / "graders" / "test_08.py"
# What the students did, each written past the audit-hook guard (paths split so that no
# argument names the repository, or libc called through ctypes): the wall must be the namespace.
# (code computing `result`, a check of it)
ESCAPES = {
    "git show of the teacher's repository": (
        f"import subprocess\nr = subprocess.run(['sh', '-c', 'cd {REPO.parent} && cd {REPO.name} "
        "&& git show HEAD:minillm/engines/r8_policies/policy.py'], capture_output=True, "
        "text=True)\nresult = (r.returncode, r.stdout[:50])",
        lambda r: r[0] != 0 and r[1] == ""),
    "sh -c cat, the path from an environment variable": (
        "import os, subprocess\n"
        "where = os.environ.get('MINILLM_LAB_FORBIDDEN', '')\n"
        "r = subprocess.run(['sh', '-c', 'cat \"$P/minillm/engines/r8_policies/policy.py\"'], "
        f"env={{'P': where or {str(REPO)!r}}}, capture_output=True, text=True)\n"
        "result = (where, r.returncode, r.stdout[:50])",
        lambda r: r[0] == "" and r[1] != 0 and r[2] == ""),
    "os.open with dir_fd of a folder above the repository": (
        f"import os\nfd = os.open({str(REPO.parent)!r}, os.O_RDONLY)\n"
        f"result = os.read(os.open({REPO.name!r} + '/minillm/engines/r8_policies/policy.py', "
        "os.O_RDONLY, dir_fd=fd), 50)", lambda r: "FileNotFoundError" in str(r)),
    "libc open() through ctypes": (
        LIBC + f"result = (libc.open({str(REFERENCE).encode()!r}, 0), ctypes.get_errno())",
        lambda r: r[0] == -1 and r[1] == 2),                 # ENOENT: not in its world
    "a hard link into the graders folder": (
        LIBC + f"result = (libc.link({str(REFERENCE).encode()!r}, "
        f"{str(GRADER.with_name('policy_copy.py')).encode()!r}), ctypes.get_errno())",
        lambda r: r[0] == -1),
    "a grader rewritten for the next student": (
        LIBC + f"result = (libc.open({str(GRADER).encode()!r}, os.O_WRONLY | os.O_APPEND), "
        "ctypes.get_errno())", lambda r: r[0] == -1),
    "its own copy of the probes rewritten": (
        "import glob\nopen(glob.glob('/lab/_probes/*')[0], 'a').write('# x')\nresult = 'written'",
        lambda r: "Read-only file system" in str(r) or "Permission denied" in str(r)),
    "/proc/<ppid>/mem of the grader": (
        "import os\nfound = []\nfor p in filter(str.isdigit, os.listdir('/proc')):\n"
        "    try:\n        cmd = open(f'/proc/{p}/cmdline', 'rb').read()\n    except OSError:\n"
        "        continue\n    if b'_bootstrap' in cmd or b'pytest' in cmd:\n"
        "        found.append(p)\n"
        "try:\n    open(f'/proc/{os.getppid()}/mem', 'rb').read(1)\n    mem = 'read'\n"
        "except OSError as e:\n    mem = type(e).__name__\n"
        "result = (found, os.getppid(), mem)", lambda r: r[0] == [] and r[2] != "read"),
    "the grader's secrets in its environment": (
        "import os\nresult = sorted(k for k in os.environ if 'SECRET' in k or 'LAB_STUDENT' in k "
        "or 'FORBIDDEN' in k)", lambda r: r == []),
    "the network": (
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)\nresult = 'out'",
        lambda r: "Error" in str(r) or "timed out" in str(r)),
    "the teacher's home and temporary files": (
        "import os\nresult = [p for p in ('/root/.ssh', '/home', '/tmp/pytest-of-root') "
        "if os.path.exists(p)]", lambda r: r == []),
}


@needs_isolation
@pytest.mark.slow
@pytest.mark.parametrize("escape", list(ESCAPES))
def test_each_escape_meets_a_wall(escape, student):
    code, holds = ESCAPES[escape]
    got = student.run(attempt, code)
    assert holds(got), f"{escape}: {got!r}"
    assert student.isolated


@needs_isolation
@pytest.mark.slow
def test_the_student_s_process_has_no_privilege_and_bounded_resources(student):
    got = student.run(attempt, "import os, resource\nresult = (os.getuid(), os.getpid(), "
                               "open('/proc/self/status').read().split('CapEff:')[1].split()[0], "
                               "resource.getrlimit(resource.RLIMIT_AS)[0], "
                               "resource.getrlimit(resource.RLIMIT_FSIZE)[0])")
    uid, pid, caps, memory, fsize = got
    assert int(caps, 16) == 0 and pid < 50 and uid in (0, 65534), got
    assert 0 < memory < 2**60 and 0 < fsize < 2**40, got
    too_much = student.run(attempt, "result = len(bytearray(64 << 30))")
    assert "MemoryError" in str(too_much), too_much


KERNELS = """
import os, torch
from minillm import LLM
from minillm.layers.attention import cpp
llm = LLM("tiny-llama", engine="paged")
ops = llm.engine.runner.net.ops
try:
    open("/extensions/planted", "w")
    wrote = "wrote"
except OSError as e:
    wrote = type(e).__name__
result = (os.environ.get("TORCH_EXTENSIONS_DIR"), llm.engine.backend.name, type(ops).__name__,
          cpp.load_kernel().__file__, getattr(getattr(ops, "module", None), "__file__", ""), wrote)
"""


@needs_isolation
@pytest.mark.slow
def test_the_jail_imports_the_teacher_s_compiled_kernels_read_only(student):
    """A paged engine in the student's process runs the C++ attention kernel and the fused ops
    that the grading process built, from the folder the jail binds read-only: no compiler runs
    for it (it compiled both afresh in every grading: ~45 s of CPU each time)."""
    from minillm.layers.attention import cpp
    from minillm.lab.shared_kernels import INSIDE, built_extensions

    if cpp.load_kernel() is None:
        pytest.skip(f"no C++ kernel to share here ({cpp.kernel_error()})")
    where, backend, ops, kernel, fused_ops, wrote = student.run(attempt, KERNELS)
    assert built_extensions() is not None and where == INSIDE
    assert (backend, ops) == ("cpp", "FusedOps")
    assert kernel.startswith(INSIDE + "/") and fused_ops.startswith(INSIDE + "/"), (kernel, fused_ops)
    assert wrote in ("OSError", "PermissionError"), "the shared kernels must be read-only"


def _alive(marker: str) -> list[int]:
    """Processes whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


DETACHED = ("import subprocess, sys\nsubprocess.Popen(['sh', '-c', 'sleep 900 # {m}'], "
            "start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, "
            "stderr=subprocess.DEVNULL)\nresult = 'started'")


@pytest.mark.slow
@pytest.mark.skipif("not os.path.isdir('/proc')", reason="needs /proc to look for orphans")
@pytest.mark.parametrize("mode", ["isolated", "fallback"])
def test_a_detached_watcher_dies_with_the_grading(mode, monkeypatch):
    """A process the student's code starts in a session of its own (to forge the next grading)
    is killed when the student's process is: its namespace (isolated) or its mark (fallback)."""
    from minillm.lab.exercises import EXERCISES
    from minillm.lab.sandbox import Student
    if mode == "isolated" and not _isolated():
        pytest.skip("no namespaces on this machine")
    if mode == "fallback":
        monkeypatch.setenv("MINILLM_LAB_ISOLATION", "off")
    marker = f"minillm-watcher-{mode}-{os.getpid()}"
    s = Student({EXERCISES["08"].module: EXERCISES["08"].source_path}, limit_s=120)
    tmp = s._tmp
    try:
        assert s.run(attempt, DETACHED.format(m=marker)) == "started"
        deadline = time.monotonic() + 30
        while not _alive(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _alive(marker), "the watcher did not start"
    finally:
        s.close()
    deadline = time.monotonic() + 30
    while _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(marker), "the watcher outlived the grading"
    assert not os.path.exists(tmp)


# --- bounded: a hang at import, garbage on the channel, a flood of output ---------------------
HANG_AT_IMPORT = "import time\ntime.sleep(600)\n"
GARBAGE = "import os\nos.write(3, b'garbage!')\n"      # fd 3: the answer channel's copy
FLOOD = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stderr.write(chunk)\n"


def _student_with(tmp_path, source: str, **options):
    from minillm.lab.exercises import EXERCISES
    from minillm.lab.sandbox import Student
    ex = EXERCISES["08"]
    path = tmp_path / ex.file_name
    path.write_text(ex.source_path.read_text() + "\n" + source)
    return Student({ex.module: path}, **options)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["isolated", "fallback"])
@pytest.mark.parametrize("case", ["hang at import", "garbage", "flood"])
def test_stalls_and_floods_are_judged_within_a_bound(case, mode, tmp_path, monkeypatch, capsys):
    """Each ends well within its limit (generous bounds: no speed is asserted), with its reason,
    and leaves neither process nor folder; a later call fails at once for a file that does it
    at import."""
    from minillm.lab.sandbox import StudentError
    if mode == "isolated" and not _isolated():
        pytest.skip("no namespaces on this machine")
    if mode == "fallback":
        monkeypatch.setenv("MINILLM_LAB_ISOLATION", "off")
    source = {"hang at import": HANG_AT_IMPORT, "garbage": GARBAGE, "flood": ""}[case]
    # 15 s where the import hangs (it only has to outlast the limit), 30 where it must finish
    # on a busy machine
    import_limit = 15 if case == "hang at import" else 30
    s = _student_with(tmp_path, source, limit_s=240, import_limit_s=import_limit)
    tmp, t = s._tmp, time.monotonic()
    try:
        with pytest.raises(StudentError) as e:
            s.run(attempt, FLOOD) if case == "flood" else s.run(ok)
        took = time.monotonic() - t
        why = {"hang at import": f"took over {import_limit} s to import",
               "garbage": "over the limit", "flood": "of output and was stopped"}[case]
        assert why in str(e.value), str(e.value)[-2000:]
        assert took < {"hang at import": import_limit + 60}.get(case, 120), took
        if case != "flood":        # the same verdict again, from what the first call learned
            with pytest.raises(StudentError) as again:
                s.run(ok)
            assert why in str(again.value), str(again.value)[-2000:]
        assert not any(Path(tmp).rglob("*.log")), "a log on disk"
    finally:
        s.close()
    assert not os.path.exists(tmp)
    with capsys.disabled():
        print(f"\n[{mode}] {case}: judged in {took:.1f} s")


def test_without_namespaces_the_class_grading_refuses_unless_allowed(tmp_path, monkeypatch):
    """The fallback (forced here): ``grade --class`` names the flag; with it, every row and the
    CSV say ``isolated: no``."""
    import csv

    from minillm.lab.__main__ import main
    from minillm.lab.jail import isolation
    from minillm.lab.teacher import grade_class, table
    monkeypatch.setenv("MINILLM_LAB_ISOLATION", "off")
    assert isolation() == (False, "turned off (MINILLM_LAB_ISOLATION=off)")
    (tmp_path / "class" / "ann").mkdir(parents=True)            # handed in nothing: no grading
    with pytest.raises(SystemExit, match="--allow-unisolated"):
        grade_class(tmp_path / "class", ["08"], tmp_path / "grades", progress=lambda *_: None)
    with pytest.raises(SystemExit, match="--allow-unisolated"):
        main(["grade", "--class", str(tmp_path / "class"), "--exercises", "08", "--out",
              str(tmp_path / "grades")])
    grades = grade_class(tmp_path / "class", ["08"], tmp_path / "grades",
                         progress=lambda *_: None, allow_unisolated=True)
    rows = list(csv.DictReader(open(tmp_path / "grades.csv")))
    assert [r["isolated"] for r in rows] == ["no"]
    assert "isolated" in table(grades).splitlines()[0]
    assert table(grades).splitlines()[1].split()[5] == "no"      # ann ✗ 0.00 0/0 0.00 no


def test_a_forged_second_outcome_is_not_believed():
    """A test has one outcome: a second line for it (even signed) makes the results void, where
    the old reader kept the first and a forger wrote first."""
    import hashlib
    import hmac
    import json

    from minillm.lab.grading import read_results
    key = b"k"
    line = lambda *m: (hmac.new(key, json.dumps(list(m)).encode(), hashlib.sha256).hexdigest()
                       + " " + json.dumps(list(m)))
    text = "\n".join([line("collected", "", json.dumps(["t"])), line("passed", "t", ""),
                      line("failed", "t", "wrong")])
    assert "second outcome" in read_results(text, key)
    assert read_results("\n".join([line("collected", "", '["t"]'), line("failed", "t", "x")]),
                        key) == (["t"], {"t": ("failed", "x")})
