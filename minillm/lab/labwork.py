"""Notebooks in a handout: the student's ``labwork/`` solutions stand in for the package's stubs.

In a handout (``lab handout``) the functions of the assigned exercises are stubs in the package
itself, so every notebook that runs the engine would stop at ``NotImplementedError``. Each
notebook's first cell calls ``use()``: for every exercise whose module in this copy is a stub and
whose solution the student has written (``labwork/<id>/<file>``, as ``lab start`` lays it out),
that file is imported in the module's place; exercises not assigned keep the package's own code
(the reference), and in the teacher's full repository nothing changes. It must run before the
engine's modules are imported (a module already imported keeps its code): the notebooks call it
first.

A notebook's engine may spawn processes (the ranks of rungs 7, 10 and 11): they import the package
afresh, so ``use()`` leaves the files it stood in, in ``$MINILLM_LABWORK_FILES``, and the package's
``__init__`` stands them in again in such a process (``stand_in_from_env``), for the modules that
are stubs there too. Grading never inherits it (``grade.py`` removes it).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path

from .exercises import EXERCISES, Exercise

FILES_ENV = "MINILLM_LABWORK_FILES"     # module -> file, as JSON, for the processes a notebook spawns


class _StandIn(importlib.abc.MetaPathFinder):
    """Answers for each stubbed module with the student's file (the module keeps its name, so
    its relative imports resolve as in the package)."""

    def __init__(self, files: dict[str, Path]):
        self.files = files

    def find_spec(self, name, path=None, target=None):
        if name in self.files:
            return importlib.util.spec_from_file_location(name, self.files[name])
        return None


def module_path(ex: Exercise) -> Path:
    """The exercise's module file, found without importing anything (``find_spec`` would import
    its packages, and a package's ``__init__`` may import the module itself)."""
    package = Path(__file__).resolve().parents[1]           # minillm/
    return package.joinpath(*ex.module.split(".")[1:]).with_suffix(".py")


def is_stub(ex: Exercise) -> bool:
    """Whether this copy's module holds the exercise's stubs (a handout's) instead of the code."""
    text = module_path(ex).read_text(encoding="utf-8")
    return f'"exercise {ex.id}: ' in text and "is not written yet" in text


def find_labwork(start: Path | None = None) -> Path | None:
    """``$MINILLM_LABWORK``, else the first ``labwork/`` in the working folder or above it (a
    notebook runs in ``notebooks/``, ``lab start`` writes at the repository's root)."""
    if os.environ.get("MINILLM_LABWORK"):
        return Path(os.environ["MINILLM_LABWORK"])
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "labwork").is_dir():
            return folder / "labwork"
    return None


def use(workdir: Path | None = None, verbose: bool = True) -> dict[str, Path]:
    """Stand the student's solutions in for this copy's stubs; returns module -> file used."""
    root = Path(workdir) if workdir else find_labwork()
    files: dict[str, Path] = {}
    for ex in EXERCISES.values():
        if not is_stub(ex):
            continue
        mine = root / ex.id / ex.file_name if root else None
        if mine is not None and mine.exists():
            files[ex.module] = mine.resolve()
        elif verbose:
            print(f"exercise {ex.id} is yours to write (python -m minillm.lab start {ex.id}); "
                  "until then the cells that run it stop at NotImplementedError")
    late = [m for m, f in files.items() if m in sys.modules    # (a re-run cell: already yours)
            and Path(getattr(sys.modules[m], "__file__", "") or "").resolve() != f]
    if late:
        raise RuntimeError(f"{', '.join(late)} already imported: call labwork.use() before "
                           "anything of minillm that runs the engine (restart the kernel)")
    if files:
        os.environ[FILES_ENV] = json.dumps({m: str(f) for m, f in files.items()})
    if _stand_in(files) and verbose:
        print("your solutions:", ", ".join(str(f) for f in files.values()))
    return files


def _stand_in(files: dict[str, Path]) -> bool:
    """Put ``files`` first on the import path (once); whether anything was added."""
    if not files or any(isinstance(f, _StandIn) and f.files == files for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, _StandIn(files))
    return True


def stand_in_from_env() -> None:
    """In a process a notebook's engine spawned: the files its ``use()`` stood in, stood in here
    too, for the modules that are stubs in this copy (never over the package's own code)."""
    try:
        named = json.loads(os.environ.get(FILES_ENV, "{}"))
    except ValueError:
        return
    stubs = {ex.module for ex in EXERCISES.values() if is_stub(ex)}
    _stand_in({m: Path(f) for m, f in named.items() if m in stubs and Path(f).is_file()})
