"""The student's process: their functions compute there, and only the values they return come back.

A grader (``graders/test_<id>.py``) runs in the teacher's process, where the package's modules are
the reference. The student's code never runs there: ``Student.run(probe, *args)`` asks a child
process to call ``probe`` (a function of the grader's file) and send back what it returned. The
child imports a copy of the package (``build_tree``) in which the exercised module *is* the
student's file, and nothing of the teacher's copy is on its path (``python -S``: no ``.pth`` and
no editable install; the copy first): the reference of the exercised functions is not importable
there. Spawned ranks (exercises 10 and 11) inherit that path, so they load the student's file too.

What comes back is decoded with ``torch.load(weights_only=True)``: tensors, numbers, strings and
lists, tuples and dicts of them, never an object with behaviour of its own (an ``__eq__`` that
says yes). A child that hangs past the call's limit is killed; one that ends (``os._exit``, a
crash), answers garbage or raises makes the test fail with that reason. The test's assertions, and
so the verdict, run here, on those values.
"""
from __future__ import annotations

import io
import os
import pickle
import queue
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

PACKAGE = Path(__file__).resolve().parents[1]           # the teacher's minillm/
CHILD_SCRIPT = Path(__file__).with_name("_child.py")
# Never in the student's tree: the graders (hidden tests) and caches.
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "graders")


# Appended to the tree's ``minillm/__init__.py``: every process that imports the package from the
# tree (the child, its spawned ranks) refuses, before any student module runs, to open or hand a
# command any file of the teacher's package (a path built at run time included), the graders aside.
GUARD = '''

def _minillm_lab_guard():
    import os as _os
    import sys as _sys
    forbidden = _os.environ.get("MINILLM_LAB_FORBIDDEN")
    allowed = _os.environ.get("MINILLM_LAB_ALLOWED") or "\\0"
    if not forbidden:
        return
    watched = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn")

    def _names(args):
        for a in args:
            if isinstance(a, (list, tuple)):
                yield from _names(a)
            elif isinstance(a, (str, bytes, _os.PathLike)):
                yield _os.path.realpath(_os.fsdecode(a)) if not isinstance(a, bytes) or \\
                    b"\\0" not in a else ""

    def hook(event, args):
        if event == "open" or event in watched:
            for name in _names(args[:2] if event == "open" else args):
                if forbidden in name and not name.startswith(allowed):
                    raise PermissionError("minillm lab: the package's own code cannot be read "
                                          "from the student's process")
    _sys.addaudithook(hook)


_minillm_lab_guard()
'''


class StudentError(AssertionError):
    """The student's process did not answer: it raised, hung, ended or sent garbage."""


def module_file(tree: Path, module: str) -> Path:
    return tree.joinpath(*module.split(".")).with_suffix(".py")


def build_tree(dest: Path, overrides: dict[str, Path]) -> Path:
    """Copy the package into ``dest/minillm``, each module of ``overrides`` replaced by its file
    (the student's); returns ``dest``, the root the child imports from."""
    shutil.copytree(PACKAGE, dest / "minillm", ignore=SKIPPED)
    for module, path in overrides.items():
        shutil.copyfile(path, module_file(dest, module))
    shutil.copyfile(CHILD_SCRIPT, dest / "_minillm_child.py")
    with open(dest / "minillm" / "__init__.py", "a", encoding="utf-8") as f:
        f.write(GUARD)
    return dest


def _site_dirs() -> list[str]:
    """Where this interpreter's packages live (torch…): the child runs with ``-S``, so it is told."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths.get("purelib"), paths.get("platlib")) if p))


def _decode(data: bytes, kinds: tuple[str, ...] = ("ok", "raised")) -> tuple:
    import torch
    try:
        msg = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:                  # noqa: BLE001 - anything unreadable is "garbage"
        raise StudentError(f"the student's process sent back something that is not plain data "
                           f"({type(e).__name__})") from None
    if not (isinstance(msg, tuple) and msg and msg[0] in kinds):
        raise StudentError("the student's process sent back an answer of the wrong shape")
    return msg


class Student:
    """One child process running the student's tree; restarted after it dies or hangs in a call,
    never after it ended while importing the student's modules (``_wait_ready``)."""

    def __init__(self, overrides: dict[str, Path], limit_s: float = 300.0):
        self._tmp = tempfile.mkdtemp(prefix="minillm-student-")
        self.root = build_tree(Path(self._tmp), {m: Path(f) for m, f in overrides.items()})
        self.modules = list(overrides)
        self.limit_s = limit_s
        self.log = Path(self._tmp) / "output.log"
        self._proc: subprocess.Popen | None = None
        self._answers: queue.Queue = queue.Queue()
        self._ends_at_import: str | None = None    # why, once the process ended before "ready"

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("PYTHON") and k != "MINILLM_LABWORK_FILES"}
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), *_site_dirs()])
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["MINILLM_LAB_FORBIDDEN"] = str(PACKAGE)
        env["MINILLM_LAB_ALLOWED"] = str(PACKAGE / "lab" / "graders")
        env["HYPOTHESIS_STORAGE_DIRECTORY"] = str(Path(self._tmp) / ".hypothesis")
        env["MINILLM_LAB_MODULES"] = ",".join(self.modules)
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", str(self.root / "_minillm_child.py")], cwd=self.root,
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._answers = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc, self._answers), daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen, answers: queue.Queue) -> None:
        """Frames (8-byte length, then the bytes) from the child, until it closes its end."""
        out = proc.stdout
        while True:
            head = out.read(8)
            if len(head) < 8:
                answers.put(None)
                return
            (n,) = struct.unpack("<Q", head)
            body = out.read(n)
            answers.put(body if len(body) == n else None)
            if len(body) < n:
                return

    def _tail(self) -> str:
        text = self.log.read_bytes()[-1500:].decode(errors="replace") if self.log.exists() else ""
        return f"\n--- the end of its output ---\n{text}" if text.strip() else ""

    def _kill(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait(timeout=60)
        proc.stdout.close()
        if proc.stdin:
            proc.stdin.close()
        return rc

    def run(self, probe: Callable, *args: Any, limit_s: float | None = None, **kwargs: Any) -> Any:
        """``probe(*args, **kwargs)`` computed in the student's process: its return value, or a
        ``StudentError`` saying why there is none (the test fails with it)."""
        if self._ends_at_import is not None:
            raise StudentError(f"{probe.__name__}: {self._ends_at_import}")
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()
            self._wait_ready(probe.__name__, limit_s or self.limit_s)
        request = pickle.dumps((str(Path(probe.__code__.co_filename).resolve()), probe.__name__,
                                args, kwargs))
        limit = limit_s or self.limit_s
        try:
            self._proc.stdin.write(struct.pack("<Q", len(request)) + request)
            self._proc.stdin.flush()
            data = self._answers.get(timeout=limit)
        except queue.Empty:
            self._kill()
            raise StudentError(f"{probe.__name__}: no answer within {limit:.0f} s (a hang or an "
                               f"endless loop in your code?){self._tail()}") from None
        except (BrokenPipeError, OSError):
            data = None
        if data is None:
            rc = self._kill()
            raise StudentError(f"{probe.__name__}: the process running your code ended (exit "
                               f"code {rc}) before it answered{self._tail()}")
        msg = _decode(data)
        if msg[0] == "raised":
            name, text, where = (list(msg[1:]) + ["", "", ""])[:3]
            raise StudentError(f"{probe.__name__}: your code raised {name}: {text}\n{where}")
        return msg[1] if len(msg) > 1 else None

    def _wait_ready(self, name: str, limit: float) -> None:
        """The child's first frame, sent once your modules are imported. A child that ends before
        it ends at every start (the import does not depend on the call): it is not started again,
        and every later call fails with the same reason at once, not after a restart each."""
        try:
            data = self._answers.get(timeout=limit)
        except queue.Empty:
            self._kill()
            raise StudentError(f"{name}: your module took over {limit:.0f} s to import (a hang "
                               f"at import?){self._tail()}") from None
        if data is None:
            rc = self._kill()
            self._ends_at_import = (f"the process running your code ended (exit code {rc}) while "
                                    f"importing your file, before any call{self._tail()}")
            raise StudentError(f"{name}: {self._ends_at_import}")
        _decode(data, ("ready",))        # anything but a "ready" frame is garbage

    def close(self) -> None:
        self._kill()
        shutil.rmtree(self._tmp, ignore_errors=True)


def student_from_env() -> Student:
    """The student a grader runs against: ``MINILLM_LAB_STUDENT`` (module=file pairs joined by
    ``os.pathsep``, set by ``grade.check``); unset, the package's own modules (the reference)."""
    spec = os.environ.get("MINILLM_LAB_STUDENT", "")
    overrides = dict(p.split("=", 1) for p in spec.split(os.pathsep) if "=" in p)
    limit = float(os.environ.get("MINILLM_LAB_CALL_LIMIT_S", "300"))
    return Student({m: Path(f) for m, f in overrides.items()}, limit)
