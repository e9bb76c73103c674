"""The layout tells the architecture, and the docs say so truly: one numbering (rung N = its
module = notebook NN = exercise N), every path the README's ladder names exists, no module grows
past what one sitting can read, the README stays a guide a newcomer reads in minutes (at most
README_MAX_LINES lines; the rest lives in docs/), and no relative link in it or in docs/ is dead."""
from __future__ import annotations

import re
from pathlib import Path

from minillm.engines import REGISTRY
from minillm.lab.exercises import EXERCISES

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 350
README_MAX_LINES = 200


def ladder_rows() -> list[dict[str, str]]:
    """The README's ladder table, one dict per rung keyed by the header's column names."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| rung | engine | module | notebook |"):].split("\n\n")[0]
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in table.splitlines()]
    return [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]


def test_readme_ladder_is_in_order_and_names_real_paths():
    rows = ladder_rows()
    assert [int(r["rung"]) for r in rows] == list(range(len(rows))), "ladder rows out of order"
    for row in rows:
        rung, module, notebook = row["rung"], row["module"], row["notebook"]
        for path in re.findall(r"`(minillm/[\w/.]+)`", module):
            assert (ROOT / path).exists(), f"rung {rung}: {path} does not exist"
        nb = re.search(r"`(\d\d)_\w+`", notebook)
        assert nb and int(nb.group(1)) == int(rung), f"rung {rung} is taught by notebook {nb}"
        assert (ROOT / "notebooks" / f"{nb.group(0).strip('`')}.ipynb").exists()


def test_registry_rungs_match_their_modules_and_the_ladder():
    rows = {int(r["rung"]): r for r in ladder_rows()}
    for spec in REGISTRY.values():
        assert spec.rung in rows, f"{spec.name}: rung {spec.rung} is not in the README's ladder"
        engine = rows[spec.rung]["engine"]
        assert f"`{spec.name}`" in engine or spec.name.startswith("paged"), spec.name
        numbered = re.search(r"\.r(\d+)_", spec.module)
        assert numbered is None or int(numbered.group(1)) == spec.rung, spec.module


def test_exercises_are_numbered_by_their_rung():
    for ex in EXERCISES.values():
        assert ex.id[:2] == ex.notebook[:2], f"exercise {ex.id} is taught by notebook {ex.notebook}"


def test_readme_ladder_names_every_exercise_on_its_rung():
    named = {}
    for row in ladder_rows():
        for ex_id in re.findall(r"`([\w-]+)`", row["exercise"]):
            named[ex_id] = int(row["rung"])
    assert set(named) == set(EXERCISES), (f"the ladder's exercise column names {sorted(named)}, "
                                          f"the lab has {sorted(EXERCISES)}")
    for ex_id, rung in named.items():
        assert int(ex_id[:2]) == rung, f"exercise {ex_id} is on rung {rung}'s row"


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


# --- the README is a guide; every relative link in it and in docs/ leads somewhere -------------

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def too_long(text: str, limit: int = README_MAX_LINES) -> str | None:
    """Why ``text`` is too long for the README, or None."""
    n = len(text.splitlines())
    return f"README.md is {n} lines, over {limit}: move the detail to docs/" if n > limit else None


def dead_links(text: str, base: Path) -> list[str]:
    """The relative links (and images) in markdown ``text`` whose file does not exist, resolved
    from the folder ``base``. URLs with a scheme and same-page anchors are skipped; an anchor
    after a path is ignored; links inside fenced code blocks and inline code are not links."""
    text = re.sub(r"`[^`\n]*`", "``", FENCE.sub("", text))
    dead = []
    for target in LINK.findall(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path and not (base / path).exists():
            dead.append(target)
    return dead


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_short_enough_for_a_newcomer():
    why = too_long((ROOT / "README.md").read_text())
    assert why is None, why


def test_too_long_catches_a_planted_long_readme():
    assert too_long("line\n" * README_MAX_LINES) is None
    assert f"{README_MAX_LINES + 1} lines" in too_long("line\n" * (README_MAX_LINES + 1))


def test_no_relative_link_in_readme_or_docs_is_dead():
    dead = {str(p.relative_to(ROOT)): d for p in markdown_files()
            if (d := dead_links(p.read_text(), p.parent))}
    assert not dead, f"links to files that do not exist: {dead}"


def test_dead_links_catches_a_planted_dead_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "HERE.md").write_text("# here\n")
    (tmp_path / "fig.png").write_text("")
    text = ("[ok](docs/HERE.md) [ok with anchor](docs/HERE.md#here) ![ok image](fig.png)\n"
            "[dead](docs/GONE.md) [dead with anchor](docs/GONE.md#x)\n"
            "![dead image](figures/none.png)\n"
            "[web](https://example.com/x.md) [anchor](#set-up) `[in code](nowhere.md)`\n"
            "```\n[in a fence](nowhere.md)\n```\n")
    assert dead_links(text, tmp_path) == ["docs/GONE.md", "docs/GONE.md#x", "figures/none.png"]
    (tmp_path / "docs" / "rungs").mkdir()
    assert dead_links("[up](../HERE.md) [too far up](../../HERE.md)", tmp_path / "docs" / "rungs") \
        == ["../../HERE.md"]
