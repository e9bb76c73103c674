"""The students' zygote, seen from the grading process: one per process, started on first use.

An isolated student's process used to be a fresh interpreter in a fresh jail: ~4 s importing
torch and Hugging Face's Llama before the first call, in each of a class's gradings. The zygote
(``_zygote.py``) is a jail holding those modules, started once; each student's process is a fork
of it, walled off as a jail of its own would be (its tree alone at ``/lab``, its own namespaces,
``nobody``): ``Zygote.spawn`` returns it as a ``Popen``-like handle ``sandbox.Student`` drives
as it drove the process it started itself. Students' trees are staged under ``staging``, which
the zygote sees at ``/trees``.

``MINILLM_LAB_ZYGOTE=off`` starts each student's process as before (the tests compare both).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from . import jail

ENV = "MINILLM_LAB_ZYGOTE"


def enabled() -> bool:
    return os.environ.get(ENV, "").lower() not in ("off", "0", "no") and \
        hasattr(socket, "send_fds") and jail.isolation()[0]


class Forked:
    """A student's process forked by the zygote, as ``subprocess.Popen`` shows one: its pipes,
    ``poll``, ``wait`` and ``kill`` (the zygote kills it, and its namespace with it)."""

    def __init__(self, zygote: "Zygote", rid: int):
        self._zygote, self.id, self.pid = zygote, rid, None
        self.returncode: int | None = None
        self._ended = threading.Event()
        self.stdin = self.stdout = self.stderr = None

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("zygote fork", timeout)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                self._zygote.send({"op": "kill", "id": self.id})
            except OSError:          # the zygote is gone, and its forks with it
                self._end(-9)


class Zygote:
    _lock = threading.Lock()
    _current: "Zygote | None" = None

    @classmethod
    def get(cls, env: dict, binds: list) -> "Zygote":
        """This process's zygote (started, or started again if it ended)."""
        with cls._lock:
            if cls._current is None or not cls._current.alive:
                cls._current = cls(env, binds)
            return cls._current

    def __init__(self, env: dict, binds: list):
        # its own folder: the jail's mount point and spec beside the trees, never among them
        self.home = tempfile.mkdtemp(prefix="minillm-zygote-")
        self.staging = os.path.join(self.home, "trees")
        for d in ("trees", "root", "lab"):
            os.mkdir(os.path.join(self.home, d), 0o755)
        os.chmod(self.home, 0o755)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec = jail.plan(os.path.join(self.home, "root"), os.path.join(self.home, "lab"), [], env,
                         hidden=(str(Path(__file__).resolve().parents[2]),),
                         shared=[*binds, (self.staging, "/trees")])
        spec["zygote"] = {"fd": theirs.fileno(),
                          "pythonpath": env.get("PYTHONPATH", "").split(os.pathsep)}
        self.proc = subprocess.Popen(jail.command(spec), env={"PATH": os.environ.get("PATH", "")},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                     preexec_fn=jail.preexec(True))
        theirs.close()
        self.alive, self._next, self._forks = True, 0, {}
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)

    def send(self, msg: dict, fds: tuple = ()) -> None:
        with self._send_lock:
            socket.send_fds(self.sock, [json.dumps(msg).encode()], list(fds))

    def spawn(self, tree: str, env: dict) -> Forked:
        """A student's process on ``tree`` (a folder under ``staging``) with ``env``."""
        rel = os.path.relpath(tree, self.staging)
        if rel.startswith(".."):
            raise ValueError(f"{tree} is not under the zygote's staging folder {self.staging}")
        ends = [os.pipe() for _ in range(3)]
        theirs = (ends[0][0], ends[1][1], ends[2][1])
        with self._send_lock:
            self._next += 1
            proc = self._forks[self._next] = Forked(self, self._next)
        proc.stdin = os.fdopen(ends[0][1], "wb")
        proc.stdout, proc.stderr = os.fdopen(ends[1][0], "rb"), os.fdopen(ends[2][0], "rb")
        try:
            self.send({"op": "spawn", "id": proc.id, "tree": rel, "env": env,
                       "limits": jail.limits()}, theirs)
        except OSError:
            proc._end(-9)
        finally:
            for fd in theirs:
                os.close(fd)
        return proc

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(1 << 16)
            except OSError:
                msg = b""
            if not msg:
                break
            reply = json.loads(msg)
            proc = self._forks.pop(reply["id"], None)
            if proc is not None:
                proc._end(reply["exit"])
        self.alive = False
        for proc in list(self._forks.values()):       # the zygote ended: so did its forks
            proc._end(-9)
        self._forks.clear()

    def close(self) -> None:
        self.alive = False
        jail.kill_tree(self.proc, True)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()
        shutil.rmtree(self.home, ignore_errors=True)
