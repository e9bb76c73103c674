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

import os
import subprocess
import sys
from pathlib import Path

from .exercises import Exercise
from .skeleton import make_skeleton

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
          timeout: int = 1200, capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``ex``'s grader with ``path`` (a student's file; None: the package's own code) standing
    in for the module. Returns the finished process (exit code 0 = passed)."""
    overrides = []
    if path is not None:
        path = Path(path).resolve()
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run `python -m minillm.lab start {ex.id}` "
                             "first (or pass --file)")
        overrides.append(f"{ex.module}={path}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")     # no stale .pyc of a student's file
    cmd = [sys.executable, str(Path(__file__).with_name("_bootstrap.py")), str(ex.grader),
           *overrides, "--", "-q", "--tb=short", "-p", "no:cacheprovider", "--no-header",
           "-o", "addopts=", "-W", "ignore::DeprecationWarning", *pytest_args]
    return subprocess.run(cmd, env=env, timeout=timeout, text=True, capture_output=capture)
