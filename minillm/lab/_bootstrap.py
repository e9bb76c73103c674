"""Run a grader with a student's files standing in for modules of the package.

Started as a *script* (``python .../_bootstrap.py RESULTS LIMIT GRADER MODULE=FILE ... -- PYTEST
ARGS``, the run's secret on stdin) so that nothing of ``minillm`` is imported before the
stand-ins are installed: a finder at the front of ``sys.meta_path`` answers for each overridden
module with the student's file, wherever in the package it is first imported. Relative imports
in the student's file resolve exactly as in the original, because the module keeps its name.

The verdict is not this process's exit code, nor pytest's reports: the student's code runs in this
process and could end it with any code (``os._exit``, ``atexit``) or patch pytest. What is loaded
here before any student code — ``Recorder`` — writes one line per test to ``RESULTS``, signed
with the secret the parent sent on stdin (HMAC-SHA256): every test collected (before ``-k``
deselects any), and each test's own outcome as the test function raised it. It also notes when a
function the graders compare with (``torch.allclose``, builtins…) was replaced, and stops a test
that runs past ``LIMIT`` seconds (``faulthandler`` prints where it was, then the process ends; the
parent sees a test with no outcome). The parent (``grade.py``) decides from that file alone.
Nothing in one process can stop code determined to read a secret out of its own memory: this
stops the generic cheats, and a teacher grades hidden tests (``lab handout``).
"""
import faulthandler
import hashlib
import hmac
import importlib.abc
import importlib.util
import json
import os
import sys

import pytest


class StandIn(importlib.abc.MetaPathFinder):
    def __init__(self, files: dict):
        self.files = files

    def find_spec(self, name, path=None, target=None):
        if name in self.files:
            return importlib.util.spec_from_file_location(name, self.files[name])
        return None


def guarded() -> dict:
    """Functions the graders' checks rely on, as they are before any student code runs."""
    import builtins
    import math

    import torch
    out = {f"builtins.{n}": (builtins, n) for n in (
        "all", "any", "len", "sorted", "isinstance", "max", "min", "sum", "abs", "list", "repr")}
    out |= {"math.isclose": (math, "isclose"), "torch.allclose": (torch, "allclose"),
            "torch.equal": (torch, "equal"), "torch.Tensor.__eq__": (torch.Tensor, "__eq__"),
            "torch.Tensor.tolist": (torch.Tensor, "tolist"),
            "torch.testing.assert_close": (torch.testing, "assert_close")}
    return {name: (owner, attr, getattr(owner, attr)) for name, (owner, attr) in out.items()}


class Recorder:
    """The pytest plugin that reports to the parent (see the module docstring)."""

    def __init__(self, secret: bytes, results: str, limit_s: float):
        self._out = open(results, "a", encoding="utf-8")
        self._key, self._limit = secret, limit_s
        self._guarded = guarded()

    def _write(self, kind: str, nodeid: str = "", detail: str = "") -> None:
        msg = json.dumps([kind, nodeid, detail])
        sig = hmac.new(self._key, msg.encode(), hashlib.sha256).hexdigest()
        self._out.write(f"{sig} {msg}\n")
        self._out.flush()

    def _replaced(self) -> list:
        return [n for n, (owner, attr, orig) in self._guarded.items()
                if getattr(owner, attr, None) is not orig]

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
        replaced = self._replaced()
        if replaced:
            self._write("failed", item.nodeid, "the code under test replaced "
                        + ", ".join(replaced) + ": graders compare with the originals")
        elif outcome.excinfo is None:
            self._write("passed", item.nodeid)
        else:
            self._write("failed", item.nodeid, repr(outcome.excinfo[1])[:300])


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]        # this folder is not a place to import from
    secret = sys.stdin.buffer.readline().strip()
    sys.stdin.close()
    results, limit_s = argv[0], float(argv[1])
    split = argv.index("--") if "--" in argv else len(argv)
    grader, overrides, pytest_args = argv[2], argv[3:split], argv[split + 1:]
    files = dict(o.split("=", 1) for o in overrides)
    recorder = Recorder(secret, results, limit_s)
    sys.meta_path.insert(0, StandIn(files))
    return pytest.main([grader, *pytest_args], plugins=[recorder])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
