"""The grading process, seen from the teacher's side: started, watched, its results read back.

One grading process (``_bootstrap.py``) grades a list of *runs*, each a student's file (or the
reference) standing in for the exercise's module: for each it runs the grader once, with that
run's own student process. Graded one after the other in one process, a class pays once for
what every grading starts with (Python, torch, pytest, hypothesis and the grader collected:
~3-5 s a grading, most of a failing one) and never shares a student's process: each run starts
its own, and the next run starts only once that one and whatever it left are killed.

The process reports through a pipe only it holds: lines signed with the run's secret
(HMAC-SHA256) — ``begin`` and ``end`` around each run, and between them the tests it collected
and each test's outcome (``Recorder``). A run that ends the process (a test past its limit, a
crash) leaves the runs after it to a new process; a run past ``timeout`` seconds from its
``begin`` (the process's start too: from its start to the first ``begin``) is killed the same
way.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import jail, zygote

MARK = "minillm-lab-run"        # the line that starts a run's share of the process's output


def run_mark(secret: str, tag: str) -> str:
    """The line that starts run ``tag``'s output: keyed, so no text a test prints can forge it."""
    return f"{MARK} {hmac.new(secret.encode(), tag.encode(), hashlib.sha256).hexdigest()[:24]}"


class ResultsPipe:
    """Reads the results pipe to its end on a thread, keeping at most ``most`` bytes (past that
    the rest is dropped, and the cut last line cannot be believed), and when the last run began
    or ended (``since``: where the clock of ``timeout`` starts)."""

    def __init__(self, fd: int | None, on_end=None, most: int = 32 << 20):
        self.chunks: list[bytes] = []
        self.since = time.monotonic()
        self._on_end = on_end
        self._most, self._size, self._line = most, 0, b""
        self._thread = threading.Thread(target=self._read, args=(fd,), daemon=True) \
            if fd is not None else None
        if self._thread:
            self._thread.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            while chunk := f.read1(1 << 16):
                if self._size < self._most:
                    self.chunks.append(chunk[:self._most - self._size])
                self._size += len(chunk)
                *lines, self._line = (self._line + chunk).split(b"\n")
                for line in lines:
                    msg = line.partition(b" ")[2]
                    if msg.startswith((b'["begin", ', b'["end", ')):
                        self.since = time.monotonic()
                    if msg.startswith(b'["end", ') and self._on_end is not None:
                        try:                   # a progress line, nothing decided: never a reason
                            self._on_end(json.loads(msg)[1])     # to stop reading the results
                        except Exception:      # noqa: BLE001
                            self._on_end = None

    def text(self, timeout: float = 30) -> str:
        if self._thread:
            self._thread.join(timeout=timeout)
        return b"".join(self.chunks).decode(errors="replace")


def run_graders(grader: Path, runs: dict[str, dict], env: dict, tmp: str, secret: str,
                timeout: float, test_limit_s: float, pytest_args: tuple,
                capture: bool, on_end=None) -> dict[str, tuple]:
    """Grade every run of ``runs`` (tag -> its environment); tag -> (the process's output as a
    ``CompletedProcess``, why it ran late or None, its results: ``read_results``'s). A process
    that ends before the last run began leaves the rest to the next one. ``on_end(tag)``: called
    (on another thread) as each run's grading ends, for a progress line."""
    graded: dict[str, tuple] = {}
    pending = list(runs)
    while pending:
        done, late, text = _one_process(grader, {t: runs[t] for t in pending}, env, tmp,
                                        secret, timeout, test_limit_s, pytest_args, capture,
                                        on_end)
        per_run = read_runs(text, secret.encode(), pending)
        began = [t for t in pending if t in per_run]
        outputs = split_output(done, began, secret, capture)
        if not began:                       # it ended before the first run began
            began, per_run, outputs = pending[:1], {pending[0]: ([], {})}, {pending[0]: done}
        for tag in began:
            why_late = late if tag == began[-1] else None
            graded[tag] = (outputs[tag], why_late, per_run[tag])
        pending = [t for t in pending if t not in graded]
    return graded


def _one_process(grader: Path, runs: dict[str, dict], env: dict, tmp: str, secret: str,
                 timeout: float, test_limit_s: float, pytest_args: tuple, capture: bool,
                 on_end=None):
    """One grading process over ``runs``, its process group killed when it ends, in time or
    not: (done, why the last run was late or None, the results pipe's text)."""
    if len(runs) == 1 and zygote.ENV not in env:
        # one student: a zygote (torch and HF's Llama imported first, ~3.5 s) would cost what
        # that student's own process costs, more where the exercise loads no model
        env = {**env, zygote.ENV: "off"}
    via_pipe = os.name == "posix"
    r, w = os.pipe() if via_pipe else (None, None)
    results = str(w) if via_pipe else str(Path(tmp) / "results")
    if not via_pipe:
        Path(results).unlink(missing_ok=True)
    # a configuration of its own, empty: not the pytest settings of whatever pyproject.toml lies
    # above the grader (a handout's is the students' to edit; the project's names a plugin's
    # options that a grading, loading no plugin, would warn about in every report)
    ini = Path(tmp) / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [sys.executable, str(Path(__file__).with_name("_bootstrap.py")), results,
           str(test_limit_s), str(grader.resolve()), "--", "-q", "--tb=short", "-c", str(ini),
           "-p", "no:cacheprovider", "--no-header", "-o", "addopts=", "--rootdir",
           str(grader.resolve().parent), "-W", "ignore::DeprecationWarning", *pytest_args]
    plan = json.dumps({"runs": [{"tag": t, "env": e, "mark": run_mark(secret, t) if capture
                                 else None} for t, e in runs.items()]})
    out = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, text=True, stdin=subprocess.PIPE, stdout=out,
                            stderr=out, **({"pass_fds": (w,), "start_new_session": True}
                                           if via_pipe else {}))
    if via_pipe:
        os.close(w)
    pipe = ResultsPipe(r if via_pipe else None, on_end)
    late, sent = None, secret + "\n" + plan + "\n"
    budget = timeout if via_pipe else timeout * len(runs)    # no pipe read as it goes: all runs
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(sent, timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                sent = None                  # written once; a retry only reads
                if time.monotonic() - pipe.since > budget:
                    late = f"the grading ran past its time limit ({timeout:.0f} s)"
                    jail.kill_tree(proc, not via_pipe)
                    stdout, stderr = proc.communicate()
                    break
    finally:
        if via_pipe:
            jail.kill_tree(proc, False)          # its group: nothing of it outlives it
    text = pipe.text() if via_pipe else (
        Path(results).read_text(encoding="utf-8") if Path(results).exists() else "")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout or "", stderr or ""), late, text


def split_output(done: subprocess.CompletedProcess, tags: list[str], secret: str,
                 capture: bool) -> dict[str, subprocess.CompletedProcess]:
    """Each run's share of the process's output (from its mark to the next run's); what came
    before the first mark (the process starting) goes to the first run."""
    if not capture:
        return {t: done for t in tags}

    def cut(text: str) -> list[str]:
        head, _, rest = text.partition(run_mark(secret, tags[0]) + "\n")
        parts, rest = [], head + rest
        for tag in tags[1:]:
            head, sep, rest = rest.partition(run_mark(secret, tag) + "\n")
            parts.append(head)
            rest = rest if sep else ""
        return parts + [rest]
    outs, errs = cut(done.stdout), cut(done.stderr)
    return {t: subprocess.CompletedProcess(done.args, done.returncode, o, e)
            for t, o, e in zip(tags, outs, errs)}


def read_runs(text: str, key: bytes,
              tags: list[str]) -> dict[str, tuple[list[str], dict] | str]:
    """The results (``read_results``) of each run that began, by tag, from the signed lines; a
    line that is not the grader's voids every run of ``tags`` (nobody can say whose it was)."""
    messages = _verified(text, key)
    if isinstance(messages, str):
        return {t: messages for t in tags}
    per_run: dict[str, list] = {}
    run: list | None = None
    for kind, nodeid, detail in messages:
        if kind == "begin":
            run = per_run[nodeid] = []
        elif kind != "end" and run is not None:
            run.append((kind, nodeid, detail))
    return {t: _outcomes(m) for t, m in per_run.items()}


def read_results(text: str, key: bytes) -> tuple[list[str], dict] | str:
    """(test ids collected, {test id: (outcome, detail)}) from one run's signed lines, or why
    they cannot be believed."""
    messages = _verified(text, key)
    return messages if isinstance(messages, str) else _outcomes(messages)


def _verified(text: str, key: bytes) -> list[tuple[str, str, str]] | str:
    """Each line's message, [kind, test id, detail], once its signature is checked; or why the
    lines cannot be believed."""
    messages = []
    for line in text.splitlines():
        sig, _, msg = line.partition(" ")
        good = hmac.new(key, msg.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sig, good):
            return "the grader's results were written over (a line is not the grader's)"
        messages.append(tuple(json.loads(msg)))
    return messages


def _outcomes(messages: list[tuple[str, str, str]]) -> tuple[list[str], dict] | str:
    collected, outcomes = [], {}
    for kind, nodeid, detail in messages:
        if kind == "collected":
            collected = json.loads(detail)
        elif nodeid in outcomes:                # a test has one outcome: a second is forged
            return f"the grader's results were written over (a second outcome for {nodeid})"
        else:
            outcomes[nodeid] = (kind, detail)
    return collected, outcomes
