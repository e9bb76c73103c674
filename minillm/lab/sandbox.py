"""The student's process: their functions compute there, and only the values they return come back.

A grader (``graders/test_<id>.py``) runs in the grading process, where the package's modules are
the reference. The student's code never runs there: ``Student.run(probe, *args)`` asks a child
process to call ``probe`` (a function of the grader's file) and send back what it returned. The
child imports a copy of the package (``build_tree``) in which the exercised module *is* the
student's file; the probe's file is copied into it too, so the child never opens the teacher's.

Where the machine allows (``jail.isolation()``), the child is isolated (``jail.py``; a fork of
the grading's zygote, ``zygote.py``, walled off alike): its own root holding that copy and the
Python environment, read-only; its own PID namespace (everything it starts dies with it); no
network; another user; limits on CPU, memory, processes and files. Elsewhere it is a plain
process of its own session, and ``isolated`` is False (the class table says so). Either way its
environment is a short list (no secret of the grader's), a guard refuses opening the teacher's
repository by name, and its process group (or namespace) is killed whatever the verdict.

What comes back is bounded — a frame (8-byte length, then the bytes) of at most
``MAX_FRAME_MB``, one per request, the first one (``ready``) within ``import_limit_s`` — and
decoded with ``torch.load(weights_only=True)``: tensors, numbers, strings and lists, tuples and
dicts of them, never an object with behaviour of its own (an ``__eq__`` that says yes). Its
output is drained by a thread that keeps the last ``TAIL`` bytes and kills it past
``OUTPUT_MB``: no log on disk. A child that hangs, ends, floods or answers garbage makes the test
fail with that reason; the test's assertions, and so the verdict, run here, on those values.
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

from . import jail, shared_kernels, zygote

PACKAGE = Path(__file__).resolve().parents[1]           # the teacher's minillm/
REPO = PACKAGE.parent                                   # its repository (.git included)
CHILD_SCRIPT = Path(__file__).with_name("_child.py")
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "graders")   # never in the tree
MAX_FRAME_MB = float(os.environ.get("MINILLM_LAB_MAX_FRAME_MB", "512"))
OUTPUT_MB = float(os.environ.get("MINILLM_LAB_OUTPUT_MB", "64"))
TAIL = 4000
KEPT_ENV = ("MINILLM_", "TORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "CUDA_", "LANG",
            "LC_", "TZ", "TERM")
GUARD = '''

def _minillm_lab_guard():
    import os as _os
    import sys as _sys
    forbidden, allowed = {forbidden!r}, {allowed!r}
    watched = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
               "os.link", "os.symlink", "os.rename", "os.replace", "os.listdir", "os.scandir",
               "os.chdir", "shutil.copyfile", "shutil.copytree", "ctypes.dlopen")

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
                if (forbidden in name + "/") and not any(name.startswith(a) for a in allowed):
                    raise PermissionError("minillm lab: the package's own code cannot be read "
                                          "from the student's process")
    _sys.addaudithook(hook)


_minillm_lab_guard()
'''


class StudentError(AssertionError):
    """The student's process did not answer: it raised, hung, ended or sent garbage."""


def module_file(tree: Path, module: str) -> Path:
    return tree.joinpath(*module.split(".")).with_suffix(".py")


def _site_dirs() -> list[str]:
    """Where this interpreter's packages live (torch…): the child runs with ``-S``, so it is told."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths.get("purelib"), paths.get("platlib")) if p))


def build_tree(dest: Path, overrides: dict[str, Path]) -> Path:
    """Copy the package into ``dest/minillm``, each module of ``overrides`` replaced by its file
    (the student's); returns ``dest``, the root the child imports from. Readable by all: the
    isolated child runs as another user."""
    shutil.copytree(PACKAGE, dest / "minillm", ignore=SKIPPED)
    for module, path in overrides.items():
        shutil.copyfile(path, module_file(dest, module))
    shutil.copyfile(CHILD_SCRIPT, dest / "_minillm_child.py")
    (dest / "_probes").mkdir()
    allowed = [d for d in _site_dirs() + [sys.prefix] if d.startswith(str(REPO) + os.sep)]
    with open(dest / "minillm" / "__init__.py", "a", encoding="utf-8") as f:
        f.write(GUARD.format(forbidden=str(REPO) + "/", allowed=allowed))
    for d, _, files in os.walk(dest):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return dest


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
    never after it ended or hung while importing the student's modules (``_wait_ready``)."""

    def __init__(self, overrides: dict[str, Path], limit_s: float = 300.0,
                 import_limit_s: float | None = None):
        self.isolated, self.isolation = jail.isolation()
        self.modules, self.mark = list(overrides), ""
        # where isolated, a fork of the grading's zygote (zygote.py): the tree staged in its sight
        self.zygote = zygote.Zygote.get(self._env(None), shared_kernels.child_binds()) \
            if self.isolated and zygote.enabled() else None
        self._tmp = tempfile.mkdtemp(prefix="minillm-student-",
                                     dir=self.zygote.staging if self.zygote else None)
        self.root = build_tree(Path(self._tmp) / "tree",
                               {m: Path(f) for m, f in overrides.items()})
        self.limit_s = limit_s
        self.import_limit_s = min(limit_s, import_limit_s or float(
            os.environ.get("MINILLM_LAB_IMPORT_LIMIT_S", "60")))
        run = os.environ.get("MINILLM_LAB_RUN", "x")   # set by grade.check for this grading
        self.mark = f"MINILLM_LAB_RUN={run}:{os.path.basename(self._tmp)}"
        self._proc: subprocess.Popen | zygote.Forked | None = None
        self._answers, self._tail, self._flooded = queue.Queue(), bytearray(), False
        self._probes: dict[str, str] = {}
        self._ends_at_import: str | None = None    # why, once the process ended before "ready"

    @property
    def inside(self) -> Path:
        """The tree, as the student's process sees it."""
        return Path("/lab") if self.isolated else self.root

    def _env(self, modules: list[str] | None) -> dict[str, str]:
        """The student's process's environment; ``modules`` None: what every student's process
        of this grading shares (the zygote's)."""
        env = {k: v for k, v in os.environ.items() if k.startswith(KEPT_ENV)
               and not k.startswith(("MINILLM_LAB", "MINILLM_LABWORK"))}
        home = "/tmp" if self.isolated else self._tmp
        env.update(PATH=os.environ.get("PATH", "/usr/bin:/bin"), HOME=home, TMPDIR=home,
                   PYTHONPATH=os.pathsep.join([str(self.inside),   # real paths: the jail's
                                               *map(os.path.realpath, _site_dirs())]),
                   PYTHONDONTWRITEBYTECODE="1",
                   HYPOTHESIS_STORAGE_DIRECTORY=os.path.join(home, ".hypothesis"))
        if self.isolated and shared_kernels.child_binds():
            env["TORCH_EXTENSIONS_DIR"] = shared_kernels.INSIDE
        if modules is not None:
            key, _, value = self.mark.partition("=")
            env.update({"MINILLM_LAB_MODULES": ",".join(modules), key: value})
        return env

    def _start(self) -> None:
        if os.environ.get(jail.ENV) == "required" and not self.isolated:
            raise StudentError(f"the student's process cannot be isolated here ({self.isolation})")
        if self.zygote is not None:
            return self._watch(self.zygote.spawn(str(self.root), self._env(self.modules)))
        argv = [jail.python() if self.isolated else sys.executable, "-S",
                str(self.inside / "_minillm_child.py")]
        if self.isolated:
            os.makedirs(os.path.join(self._tmp, "root"), exist_ok=True)
            spec = jail.plan(os.path.join(self._tmp, "root"), str(self.root), argv,
                             self._env(self.modules), hidden=(str(REPO),),
                             shared=shared_kernels.child_binds())
            cmd, options = jail.command(spec), {"env": {"PATH": os.environ.get("PATH", "")}}
        else:
            cmd, options = argv, {"env": self._env(self.modules), "cwd": self.root,
                                  "start_new_session": True}
        if os.name != "posix":
            options.pop("start_new_session", None)
        else:
            options["preexec_fn"] = jail.preexec(self.isolated)
        self._watch(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, **options))

    def _watch(self, proc) -> None:
        self._proc = proc
        self._answers, self._tail, self._flooded = queue.Queue(), bytearray(), False
        threading.Thread(target=self._read, args=(proc, self._answers), daemon=True).start()
        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen, answers: queue.Queue) -> None:
        """Frames from the child until it closes its end, sends a frame too long, or one more
        than was asked for (a request is answered once): then a reason, and nothing more."""
        out, most = proc.stdout, int(MAX_FRAME_MB * 2**20)
        while True:
            if answers.qsize() > 1:
                answers.put(("bad", "it sent answers nobody asked for"))
                return
            head = out.read(8)
            if len(head) < 8:
                answers.put(None)
                return
            (n,) = struct.unpack("<Q", head)
            if n > most:
                answers.put(("bad", f"it sent a frame of {n} bytes, over the limit of "
                                    f"{MAX_FRAME_MB:.0f} MiB (garbage on the answer channel?)"))
                return
            body = out.read(n)
            answers.put(body if len(body) == n else None)
            if len(body) < n:
                return

    def _drain(self, proc: subprocess.Popen) -> None:
        """The child's output (prints, tracebacks): the last ``TAIL`` bytes kept; past
        ``OUTPUT_MB`` in all, the child is killed (a print in an endless loop fills no disk)."""
        total = 0
        while chunk := proc.stderr.read1(1 << 16):
            total += len(chunk)
            self._tail = (self._tail + chunk)[-TAIL:]
            if total > OUTPUT_MB * 2**20 and not self._flooded:
                self._flooded = True
                jail.kill_tree(proc, self.isolated)

    def tail(self) -> str:
        text = bytes(self._tail).decode(errors="replace")
        flood = (f"\n(it wrote over {OUTPUT_MB:.0f} MiB of output and was stopped: a print in "
                 "a loop?)") if self._flooded else ""
        return flood + (f"\n--- the end of its output ---\n{text}" if text.strip() else "")

    def _kill(self) -> int | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        jail.kill_tree(proc, self.isolated)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = None
        jail.kill_marked(self.mark)
        for f in (proc.stdout, proc.stdin, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        return rc

    def _probe(self, probe: Callable) -> str:
        """Where the child finds ``probe``'s file: a copy in its tree (never the teacher's)."""
        src = str(Path(probe.__code__.co_filename).resolve())
        if src not in self._probes:
            name = f"p{len(self._probes)}_{Path(src).name}"
            shutil.copyfile(src, self.root / "_probes" / name)
            os.chmod(self.root / "_probes" / name, 0o644)
            self._probes[src] = str(self.inside / "_probes" / name)
        return self._probes[src]

    def _get(self, limit: float) -> bytes | None:
        item = self._answers.get(timeout=limit)
        if isinstance(item, tuple):
            self._kill()
            raise StudentError(f"the student's process broke the answer channel: {item[1]}")
        return item

    def run(self, probe: Callable, *args: Any, limit_s: float | None = None, **kwargs: Any) -> Any:
        """``probe(*args, **kwargs)`` computed in the student's process: its return value, or a
        ``StudentError`` saying why there is none (the test fails with it)."""
        if self._ends_at_import is not None:
            raise StudentError(f"{probe.__name__}: {self._ends_at_import}")
        if self._proc is not None and not self._answers.empty():
            extra = self._answers.get_nowait()       # None: it ended since (started again)
            self._kill()
            if extra is not None:
                why = extra[1] if isinstance(extra, tuple) else "it sent answers nobody asked for"
                raise StudentError(f"{probe.__name__}: the student's process broke the answer "
                                   f"channel: {why}")
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()
            self._wait_ready(probe.__name__)
        request = pickle.dumps((self._probe(probe), probe.__name__, args, kwargs))
        limit = limit_s or self.limit_s
        try:
            self._proc.stdin.write(struct.pack("<Q", len(request)) + request)
            self._proc.stdin.flush()
            data = self._get(limit)
        except queue.Empty:
            self._kill()
            raise StudentError(f"{probe.__name__}: no answer within {limit:.0f} s (a hang or an "
                               f"endless loop in your code?){self.tail()}") from None
        except (BrokenPipeError, OSError):
            data = None
        if data is None:
            rc = self._kill()
            raise StudentError(f"{probe.__name__}: the process running your code ended (exit "
                               f"code {rc}) before it answered{self.tail()}")
        msg = _decode(data)
        if msg[0] == "raised":
            name, text, where = (list(msg[1:]) + ["", "", ""])[:3]
            raise StudentError(f"{probe.__name__}: your code raised {name}: {text}\n{where}")
        return msg[1] if len(msg) > 1 else None

    def _wait_ready(self, name: str) -> None:
        """The child's first frame, sent once your modules are imported, within
        ``import_limit_s``. A child that ends or hangs before it would at every start (the import
        does not depend on the call): it is not started again, and every later call fails with
        the same reason at once, not after a restart each."""
        try:
            data = self._get(self.import_limit_s)
        except queue.Empty:
            self._kill()
            self._ends_at_import = (f"your module took over {self.import_limit_s:.0f} s to import "
                                    f"(a hang at import?){self.tail()}")
            raise StudentError(f"{name}: {self._ends_at_import}") from None
        except StudentError as e:
            self._ends_at_import = str(e)
            raise
        if data is None:
            rc = self._kill()
            self._ends_at_import = (f"the process running your code ended (exit code {rc}) while "
                                    f"importing your file, before any call{self.tail()}")
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
