"""``start`` gives a student the skeleton of an exercise; ``check`` grades it by behaviour.

    python -m minillm.lab start 03          # writes labwork/03/block_manager.py
    python -m minillm.lab check 03          # runs the grader against labwork/03/block_manager.py
    python -m minillm.lab check 03 --reference   # the package's own code (must pass)

The grader runs in the teacher's process (``_bootstrap.py``, a fresh Python with the package's
own modules: the reference), never with the student's code in it. Each test sends its inputs to the
student's process (``sandbox.Student``: a copy of the package in which the student's file *is* the
module, so the real engine runs the student's code), gets the returned values back as plain data,
and judges them here: against the reference, Hugging Face ``generate`` or the function's contract.
Code is never compared with code to pass: any correct solution passes; ``flags`` only lists a
near-copy of the reference (which scores 0) and lines a teacher should read.
"""
from __future__ import annotations

import ast
import hashlib
import os
import secrets
import subprocess
import tempfile
from pathlib import Path

from . import flags, grading, jail
from .exercises import Exercise
from .skeleton import make_skeleton

DEFAULT_DIR = Path("labwork")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]     # the folder that holds minillm/
SHIPPED_GRADERS = "lab-graders"      # where `lab handout --with-graders` puts them


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


def judged_outside(grader: Path) -> bool:
    """Whether the grader runs the student's code in the student's process (``OUTSIDE = True`` at
    its top level, as every grader of this package does). One without it (a teacher's own grader,
    say) would judge in the process the student's code runs in: ``check`` refuses it."""
    tree = ast.parse(grader.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "OUTSIDE" for t in n.targets)
               and getattr(n.value, "value", False) is True for n in tree.body)


def _stand_ins(ex: Exercise, path: Path | None, also: dict[str, Path] | None) -> dict[str, Path]:
    files = {m: Path(f).resolve() for m, f in (also or {}).items() if m != ex.module}
    if path is not None:
        files[ex.module] = Path(path).resolve()
    return files


def _refused(cmd: list, why: str, capture: bool) -> subprocess.CompletedProcess:
    """A grading that ends before any test runs (a file that does not parse)."""
    done = subprocess.CompletedProcess(cmd, 1, f"\nverdict: not passed: {why}\n", "")
    done.results, done.review = ([], {}), {"copy": None, "lines": [], "why": ""}
    done.isolated, done.tampered = jail.isolation(), []
    if not capture:
        print(done.stdout, end="")
    return done


def check(ex: Exercise, path: Path | None = None, pytest_args: tuple[str, ...] = (),
          timeout: int = 1200, capture: bool = False, test_limit_s: float = 300.0,
          graders: Path | None = None,
          also: dict[str, Path] | None = None) -> subprocess.CompletedProcess:
    """Run ``ex``'s grader with ``path`` (a student's file; None: the package's own code) standing
    in for the module. Returns the finished process whose ``returncode`` is the verdict (0 =
    passed), decided here from the grading process's results (``verdict``); ``stdout`` ends with
    the verdict's reason when captured. ``timeout``: the grading (and, apart, the grading
    process's start); ``test_limit_s``: each test, and each call into the student's process. ``graders``: a folder holding ``test_<id>.py`` and
    its ``conftest.py`` (a teacher's, for a handout without them); ``also``: more stand-ins,
    module -> file (a student's other exercises, in a handout). ``done.results``: (test ids
    collected, {test id: (outcome, detail)}); ``done.review``: ``flags.review`` of the file."""
    return check_many(ex, [path], pytest_args, timeout, capture, test_limit_s, graders, also)[0]


def check_many(ex: Exercise, paths: list[Path | None], pytest_args: tuple[str, ...] = (),
               timeout: int = 1200, capture: bool = False, test_limit_s: float = 300.0,
               graders: Path | None = None, also: dict[str, Path] | None = None,
               on_graded=None) -> list[subprocess.CompletedProcess]:
    """``check`` for each of ``paths`` in turn, in one grading process (``grading.py``: each
    file with a student process of its own; the process's start paid once). ``timeout``: each
    file's grading. One ``check`` result per path, in order; ``on_graded(i)`` as the grading of
    ``paths[i]`` ends (a progress line; the verdicts come once all are graded)."""
    shipped = PACKAGE_ROOT / SHIPPED_GRADERS       # a handout made with --with-graders
    if graders is None and not ex.grader.exists() and shipped.is_dir():
        graders = shipped
    grader = Path(graders) / ex.grader.name if graders else ex.grader
    if not grader.exists():
        raise SystemExit(f"no grader {grader}: this copy has none (a handout?): your teacher "
                         f"grades with theirs, or pass --graders FOLDER")
    for path in paths:
        if path is not None and not Path(path).exists():
            raise SystemExit(f"{Path(path).resolve()} does not exist: run `python -m minillm.lab "
                             f"start {ex.id}` first (or pass --file)")
    if not judged_outside(grader):
        raise SystemExit(f"{grader} does not judge outside the student's process (no `OUTSIDE = "
                         "True`): its tests would run the student's code in the grading process, "
                         "where nothing it reports can be believed. Write it with "
                         "`student.run(probe, ...)` (see minillm/lab/sandbox.py)")
    done: list = [None] * len(paths)
    runs: dict[str, dict] = {}
    for i, path in enumerate(paths):
        files = _stand_ins(ex, path, also)
        why = next((f"{f.name}: {w}" for f in files.values()
                    if (w := flags.syntax_error(f)) is not None), None)
        if why is not None:
            done[i] = _refused([], why, capture)
        else:       # MINILLM_LAB_RUN: on every process the run's student starts (jail.kill_marked)
            runs[str(i)] = {"MINILLM_LAB_STUDENT": os.pathsep.join(f"{m}={f}"
                                                                    for m, f in files.items()),
                            "MINILLM_LAB_RUN": secrets.token_hex(8)}
    if not runs:
        return done
    # a notebook's labwork.use() must not stand the student's files in for the grader's reference
    env = {k: v for k, v in os.environ.items() if k != "MINILLM_LABWORK_FILES"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")     # no stale .pyc of a student's file
    # only the plugins the grading names (its Recorder): pytest marks every module of an
    # autoloaded plugin's package for assertion rewriting, and with no bytecode written it
    # rewrote ~120 (hypothesis's) in every grading, ~2 s of its CPU
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["MINILLM_LAB_CALL_LIMIT_S"] = str(test_limit_s)
    isolated = jail.isolation()
    env[jail.ENV] = "required" if isolated[0] else "off"     # the grader's student: the same
    secret = secrets.token_hex(32)
    before = teacher_files(grader, ex.source_path)
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as tmp:
        env["HYPOTHESIS_STORAGE_DIRECTORY"] = str(Path(tmp) / ".hypothesis")   # no litter
        env["TMPDIR"] = tmp                  # the student's folders too: removed with this one
        graded = grading.run_graders(grader, runs, env, tmp, secret, timeout, test_limit_s,
                                     pytest_args, capture,
                                     on_graded and (lambda tag: on_graded(int(tag))))
        for run in runs.values():            # whatever was left behind
            jail.kill_marked(f"MINILLM_LAB_RUN={run['MINILLM_LAB_RUN']}:", exact=False)
    after = teacher_files(grader, ex.source_path)
    changed = sorted(f for f in set(before) | set(after) if before.get(f) != after.get(f))
    for tag, (proc, late, results) in graded.items():
        proc.results, proc.tampered, proc.isolated = results, changed, isolated
        done[int(tag)] = _judged(ex, paths[int(tag)], proc, late, capture)
    return done


def _judged(ex: Exercise, path: Path | None, done: subprocess.CompletedProcess,
            late: str | None, capture: bool) -> subprocess.CompletedProcess:
    """The verdict on one file from its run's results, the review of its lines and whether the
    teacher's files stayed as they were: written at the end of ``stdout`` (or printed)."""
    why = late or verdict(done.results, ex, path)
    if done.tampered:
        why = (f"the teacher's files changed during this grading ({', '.join(done.tampered[:3])}"
               "): the grading cannot be trusted, nor the next ones until they are restored")
    done.review = flags.review(ex.source_path, Path(path), ex.functions) if path is not None \
        else {"copy": None, "why": "", "lines": []}
    if why is None and done.review["copy"] is not None:
        why = (f"a near-copy of the package's own {ex.file_name}, not a solution: "
               f"{done.review['why']}")
    note = format_review(done.review)
    note += f"\nisolated: {'yes' if done.isolated[0] else 'no'} ({done.isolated[1]})"
    note += f"\nverdict: {'passed' if why is None else 'not passed: ' + why}\n"
    if capture:
        done.stdout = (done.stdout or "") + note
    else:
        print(note, end="")
    done.returncode = 0 if why is None else 1
    return done


def teacher_files(grader: Path, *also: Path) -> dict[str, str]:
    """A digest of the files a grading relies on most: the grader's folder, the lab's modules and
    ``also`` (the exercise's reference module). A student's process that wrote any of them is
    caught by comparing (isolated, it cannot; this is for the fallback)."""
    files = [*Path(grader).resolve().parent.rglob("*.py"), *Path(__file__).parent.glob("*.py"),
             *map(Path, also)]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(set(files))
            if "__pycache__" not in f.parts and f.is_file()}


def format_review(review: dict) -> str:
    """The lines a teacher should read (``flags.suspicious_lines``), one per line."""
    if not review["lines"]:
        return ""
    rows = "".join(f"\n  line {n}: [{what}] {line}" for n, what, line in review["lines"][:20])
    return f"\nfor the teacher's review ({len(review['lines'])} line(s) reach into the machinery):{rows}"


def verdict(results: tuple[list[str], dict] | str, ex: Exercise,
            path: Path | None) -> str | None:
    """None if every test of the grader ran and passed; else why not."""
    if isinstance(results, str):
        return results
    collected, outcomes = results
    if not collected:
        return ("the grader collected no test (an error in the grader or its set-up: the output "
                "above says where)")
    missing = [n for n in collected if n not in outcomes]
    failed = [(n, d) for n, (k, d) in outcomes.items() if k != "passed"]
    if failed:
        return f"{len(failed)} test(s) failed, first {failed[0][0]}: {failed[0][1]}"
    if missing:
        return (f"{len(outcomes)} of the grader's {len(collected)} tests ran; {len(missing)} did "
                f"not finish, first {missing[0]} (a time limit, a crash, or a run cut short with "
                "-x/-k: only a full run counts)")
    return None
