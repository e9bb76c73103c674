"""The layout tells the architecture, and the docs say so truly: one numbering (rung N = its
module = notebook NN = exercise N), every path the README's ladder names exists, no module grows
past what one sitting can read."""
from __future__ import annotations

import re
from pathlib import Path

from minillm.engines import REGISTRY
from minillm.lab.exercises import EXERCISES

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 350


def ladder_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| rung | engine | module | notebook |"):].split("\n\n")[0]
    return [[c.strip() for c in row.strip("|").split("|")] for row in table.splitlines()[2:]]


def test_readme_ladder_is_in_order_and_names_real_paths():
    rows = ladder_rows()
    assert [int(r[0]) for r in rows] == list(range(len(rows))), "ladder rows out of order"
    for rung, _, module, notebook, _ in rows:
        for path in re.findall(r"`(minillm/[\w/.]+)`", module):
            assert (ROOT / path).exists(), f"rung {rung}: {path} does not exist"
        nb = re.search(r"`(\d\d)_\w+`", notebook)
        assert nb and int(nb.group(1)) == int(rung), f"rung {rung} is taught by notebook {nb}"
        assert (ROOT / "notebooks" / f"{nb.group(0).strip('`')}.ipynb").exists()


def test_registry_rungs_match_their_modules_and_the_ladder():
    rows = {int(r[0]): r for r in ladder_rows()}
    for spec in REGISTRY.values():
        assert spec.rung in rows, f"{spec.name}: rung {spec.rung} is not in the README's ladder"
        assert f"`{spec.name}`" in rows[spec.rung][1] or spec.name.startswith("paged"), spec.name
        numbered = re.search(r"\.r(\d+)_", spec.module)
        assert numbered is None or int(numbered.group(1)) == spec.rung, spec.module


def test_exercises_are_numbered_by_their_rung():
    for ex in EXERCISES.values():
        assert ex.id[:2] == ex.notebook[:2], f"exercise {ex.id} is taught by notebook {ex.notebook}"


def test_no_module_is_too_long_to_read_in_one_sitting():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "minillm").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_architecture_doc_names_real_files():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:core|engines)/[\w/.]+)`", text))
    assert named, "docs/ARCHITECTURE.md names no module"
    missing = sorted(p for p in named if not (ROOT / "minillm" / p).exists())
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"
    core = ROOT / "minillm" / "core"
    for f in core.glob("*.py"):
        if f.name != "__init__.py":
            assert f"`{f.name}`" in text, f"docs/ARCHITECTURE.md does not say what core/{f.name} owns"
