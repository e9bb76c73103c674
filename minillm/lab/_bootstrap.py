"""Run a grader in the grading process and record each test's outcome for ``grade.check``.

Started as a *script* (``python .../_bootstrap.py FD LIMIT GRADER -- PYTEST ARGS``; on stdin the
run's secret, then the plan: the runs to grade, each a student's file standing in for the
module, as ``grading.py`` writes it). No student code runs here: the grader's tests run the
student's functions in the student's process (``sandbox.Student``, one per run) and judge the
returned values in this one, against the package's own modules (the reference). The verdict is
still not this process's exit code: ``Recorder`` writes lines to the pipe ``FD`` (inherited from
``grade.check``, which reads the other end: no file anyone could write to), signed with the
secret (HMAC-SHA256) — ``begin`` and ``end`` around each run, every test collected (before
``-k`` deselects any), and each test's own outcome as the test function raised it; and it stops
a test that runs past ``LIMIT`` seconds (``faulthandler`` prints where it was, then the process
ends; the parent sees a test with no outcome, and grades the runs after it in a new process).
Each run imports the grader's modules afresh (``forget_grader``): what a grader keeps at module
level is never one student's for the next.
The parent decides from those lines alone. On Linux this process is not dumpable: a process of
the same user cannot read its memory (the secret) through ``/proc``.
"""
import faulthandler
import gc
import hashlib
import hmac
import json
import os
import sys

import pytest


class Recorder:
    """The pytest plugin that reports to the parent (see the module docstring)."""

    def __init__(self, secret: bytes, results: str, limit_s: float):
        self._out = os.fdopen(int(results), "w", encoding="utf-8") if results.isdigit() else \
            open(results, "a", encoding="utf-8")        # a file where no pipe is inherited
        self._key, self._limit = secret, limit_s

    def grade(self, tag: str, env: dict, pytest_argv: list[str], mark: str | None) -> int:
        """One run: its student (``env``: the file standing in, the run's marker), the grader
        over it. The run's student process ends with its session (the ``student`` fixture's
        ``close`` kills it and whatever it started) before the next run begins."""
        forget_grader(pytest_argv[0])
        os.environ.update(env)
        if mark:                     # where this run's share of the output starts
            for stream in (sys.stdout, sys.stderr):
                print(mark, file=stream, flush=True)
        self._write("begin", tag)
        try:
            return int(pytest.main(list(pytest_argv), plugins=[self]))
        finally:
            gc.collect()             # its session's fixtures (a model, an engine) before the next
            self._write("end", tag)

    def _write(self, kind: str, nodeid: str = "", detail: str = "") -> None:
        msg = json.dumps([kind, nodeid, detail])
        sig = hmac.new(self._key, msg.encode(), hashlib.sha256).hexdigest()
        self._out.write(f"{sig} {msg}\n")
        self._out.flush()

    @pytest.hookimpl(tryfirst=True)        # before -k and -m deselect: the whole grader
    def pytest_collection_modifyitems(self, session, config, items):
        self._write("collected", detail=json.dumps([i.nodeid for i in items]))

    def pytest_runtest_setup(self, item):
        faulthandler.dump_traceback_later(self._limit, exit=True)

    def pytest_runtest_teardown(self, item):
        faulthandler.cancel_dump_traceback_later()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        outcome = yield
        if outcome.excinfo is None:
            self._write("passed", item.nodeid)
        else:
            self._write("failed", item.nodeid, str(outcome.excinfo[1])[:600])


def forget_grader(grader: str) -> None:
    """Drop the grader's folder's modules (its tests and conftest) from ``sys.modules``: the next
    run imports them afresh, as a process of its own would. A grader may keep what it computed at
    module level (a student's answers, once per session): never one student's for the next."""
    folder = os.path.dirname(os.path.abspath(grader)) + os.sep
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(folder):
            del sys.modules[name]


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]        # this folder is not a place to import from
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(4, 0, 0, 0, 0)          # PR_SET_DUMPABLE: 0
    secret = sys.stdin.buffer.readline().strip()
    plan = json.loads(sys.stdin.buffer.readline())
    sys.stdin.close()
    results, limit_s, grader = argv[0], float(argv[1]), argv[2]
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    recorder = Recorder(secret, results, limit_s)
    rc = 0
    for run in plan["runs"]:
        rc = max(rc, recorder.grade(run["tag"], run["env"], [grader, *pytest_args],
                                    run.get("mark")))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
