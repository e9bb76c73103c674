"""``start`` gives a student the skeleton of an exercise; ``check`` grades it by behaviour.

    python -m minillm.lab start 03          # writes labwork/03/block_manager.py
    python -m minillm.lab check 03          # runs the grader against labwork/03/block_manager.py
    python -m minillm.lab check 03 --reference   # the package's own code (must pass)

The grader runs in a fresh Python process (``_bootstrap.py``) in which the student's file *is*
the package's module, so the real engine — scheduler, runner, sampler — runs the student's code
and the grader compares tokens with Hugging Face ``generate`` and checks invariants. Code is never
compared with code: any correct solution passes.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

from .exercises import Exercise
from .skeleton import function_bodies, make_skeleton

DEFAULT_DIR = Path("labwork")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]     # the folder that holds minillm/


def student_file(ex: Exercise, workdir: Path = DEFAULT_DIR) -> Path:
    return Path(workdir) / ex.id / ex.file_name


def start(ex: Exercise, workdir: Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Write the skeleton; refuse to overwrite a student's work unless ``force``."""
    path = student_file(ex, workdir)
    if path.exists() and not force:
        raise SystemExit(f"{path} already exists (your work?): edit it, or pass --force to start "
                         "over from a fresh skeleton")
    path.parent.mkdir(parents=True, exist_ok=True)
    source = ex.source_path.read_text(encoding="utf-8")
    path.write_text(make_skeleton(source, ex.functions, ex.id, ex.hint), encoding="utf-8")
    return path


def check(ex: Exercise, path: Path | None = None, pytest_args: tuple[str, ...] = (),
          timeout: int = 1200, capture: bool = False, test_limit_s: float = 300.0,
          graders: Path | None = None,
          also: dict[str, Path] | None = None) -> subprocess.CompletedProcess:
    """Run ``ex``'s grader with ``path`` (a student's file; None: the package's own code) standing
    in for the module. Returns the finished process whose ``returncode`` is the verdict (0 =
    passed), decided here from the signed results (``verdict``), never from the exit code of the
    process that ran the student's code; ``stdout`` ends with the verdict's reason when captured.
    ``timeout``: the whole grading; ``test_limit_s``: each test. ``graders``: a folder holding
    ``test_<id>.py`` and its ``conftest.py`` (a teacher's, for a handout without them); ``also``:
    more stand-ins, module -> file (a student's other exercises, in a handout). The parsed
    results are ``done.results``: (test ids collected, {test id: (outcome, detail)})."""
    grader = Path(graders) / ex.grader.name if graders else ex.grader
    if not grader.exists():
        raise SystemExit(f"no grader {grader}: this copy has none (a handout?): your teacher "
                         f"grades with theirs, or pass --graders FOLDER")
    overrides = [f"{module}={Path(f).resolve()}" for module, f in (also or {}).items()
                 if module != ex.module]
    if path is not None:
        path = Path(path).resolve()
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run `python -m minillm.lab start {ex.id}` "
                             "first (or pass --file)")
        overrides.append(f"{ex.module}={path}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")     # no stale .pyc of a student's file
    secret = secrets.token_hex(32)
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as tmp:
        results = Path(tmp) / "results"
        cmd = [sys.executable, str(Path(__file__).with_name("_bootstrap.py")), str(results),
               str(test_limit_s), str(grader), *overrides, "--", "-q", "--tb=short", "-p",
               "no:cacheprovider", "--no-header", "-o", "addopts=", "-W",
               "ignore::DeprecationWarning", *pytest_args]
        try:
            done = subprocess.run(cmd, env=env, timeout=timeout, text=True, input=secret + "\n",
                                  capture_output=capture)
            late = None
        except subprocess.TimeoutExpired as e:
            done = subprocess.CompletedProcess(cmd, 1, _text(e.stdout), _text(e.stderr))
            late = f"the grading ran past its time limit ({timeout} s)"
        text = results.read_text(encoding="utf-8") if results.exists() else ""
        done.results = read_results(text, secret.encode())
        why = late or verdict(done.results, ex, path)
    note = f"\nverdict: {'passed' if why is None else 'not passed: ' + why}\n"
    if capture:
        done.stdout = (done.stdout or "") + note
    elif why is not None:
        print(note, end="")
    done.returncode = 0 if why is None else 1
    return done


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def read_results(text: str, key: bytes) -> tuple[list[str], dict] | str:
    """(test ids collected, {test id: (outcome, detail)}) from the signed lines, or why they
    cannot be believed."""
    collected, outcomes = [], {}
    for line in text.splitlines():
        sig, _, msg = line.partition(" ")
        good = hmac.new(key, msg.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sig, good):
            return "the grader's results were written over (a line is not the grader's)"
        kind, nodeid, detail = json.loads(msg)
        if kind == "collected":
            collected = json.loads(detail)
        else:
            outcomes.setdefault(nodeid, (kind, detail))
    return collected, outcomes


def verdict(results: tuple[list[str], dict] | str, ex: Exercise,
            path: Path | None) -> str | None:
    """None if every test of the grader ran and passed, by the signed results; else why not."""
    if isinstance(results, str):
        return results
    collected, outcomes = results
    if not collected:
        return "no test of the grader ran (did the code end the process while it was imported?)"
    missing = [n for n in collected if n not in outcomes]
    failed = [(n, d) for n, (k, d) in outcomes.items() if k != "passed"]
    if failed:
        return f"{len(failed)} test(s) failed, first {failed[0][0]}: {failed[0][1]}"
    if missing:
        return (f"{len(missing)} of {len(collected)} tests did not finish, first {missing[0]} "
                "(a time limit, a crash, or a run cut short with -x/-k: only a full run counts)")
    if path is not None and copies_reference(ex, path):
        return (f"the functions of exercise {ex.id} in {path.name} are the package's own code, "
                "not a solution")
    return None


def copies_reference(ex: Exercise, path: Path) -> bool:
    """Whether every exercised function of the student's file is the reference's, statement for
    statement (docstrings and comments aside), or the file runs the package's own module."""
    text = path.read_text(encoding="utf-8")
    if ex.source_path.name in text and ("exec" in text or "import_module" in text
                                        or "spec_from" in text):
        return True
    try:
        mine = function_bodies(text, ex.functions)
    except SyntaxError:
        return False
    return mine == function_bodies(ex.source_path.read_text(encoding="utf-8"), ex.functions)
