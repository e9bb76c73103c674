"""docs/LAYOUT.md's tree is the tree: every path it names exists, and every package and top-level
module of ``minillm/`` and every folder of ``tests/`` is named in it. (``test_layout.py`` checks
docs/ARCHITECTURE.md's paths and the README's ladder.)

The tree is the fenced block that opens with ``minillm/``. A line whose text starts before
``TREE_COLUMN`` is an entry: names (``a.py, b.py`` or ``folder/``), then, after two spaces or
more, what they hold; a folder's entries are indented under it. A line indented further only
continues a description."""
from __future__ import annotations

import re
from pathlib import Path

from test_layout import ROOT

TREE_COLUMN = 20
ENTRY = re.compile(r"^( *)(\S.*?)(?: {2,}.*)?$")
NAME = re.compile(r"[\w.-]+/?")
# a path in backticks anywhere on the page: minillm/..., tests/..., or a folder of the package
# (`core/`, `engines/r8_policies/`)
BACKTICKED = re.compile(r"`((?:[\w.-]+/)+[\w.-]*)`")
TOP = ("minillm", "tests", "docs", "notebooks", "figures")


def tree(text: str) -> str:
    """The fenced block of ``text`` that opens with ``minillm/``."""
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        if block.startswith("minillm/"):
            return block
    raise AssertionError("the page has no tree (a fenced block opening with minillm/)")


def tree_paths(text: str) -> list[str]:
    """Every path the tree names, from the repository's root; a folder's ends with ``/``."""
    paths: list[str] = []
    folders: list[tuple[int, str]] = []      # (indent, path) of the folders above this line
    for line in tree(text).splitlines():
        m = ENTRY.match(line)
        if m is None or len(m.group(1)) >= TREE_COLUMN:
            continue
        indent = len(m.group(1))
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = folders[-1][1] if folders else ""
        for name in (n.strip() for n in m.group(2).split(",")):
            assert NAME.fullmatch(name), f"tree line {line.strip()!r}: {name!r} is not a name"
            paths.append(parent + name)
            if name.endswith("/"):
                folders.append((indent, parent + name))
    return paths


def named_paths(text: str) -> list[str]:
    """The tree's paths and every path in backticks on the page (a folder of the package by
    itself, ``core/``, is read as ``minillm/core/``)."""
    out = tree_paths(text)
    for path in BACKTICKED.findall(text):
        out.append(path if path.split("/")[0] in TOP else f"minillm/{path}")
    return out


def required_paths(root: Path) -> set[str]:
    """What the tree must name: every package (a folder with ``__init__.py``) and top-level
    module under ``minillm/``, and every folder of ``tests/``."""
    pkg = root / "minillm"
    out = {f"{d.relative_to(root).as_posix()}/" for d in [pkg, *pkg.rglob("*")]
           if d.is_dir() and (d / "__init__.py").exists()}
    out |= {f"minillm/{f.name}" for f in pkg.glob("*.py")}
    out |= {f"tests/{d.name}/" for d in (root / "tests").iterdir()
            if d.is_dir() and not d.name.startswith(("__", "."))}
    return out


def layout_problems(text: str, root: Path) -> tuple[list[str], list[str]]:
    """(paths the page names that do not exist, paths that exist and the tree does not name)."""
    missing = sorted({p for p in named_paths(text) if not (root / p).exists()})
    unnamed = sorted(required_paths(root) - set(tree_paths(text)))
    return missing, unnamed


def test_layout_doc_names_every_package_and_nothing_that_is_gone():
    missing, unnamed = layout_problems((ROOT / "docs" / "LAYOUT.md").read_text(), ROOT)
    assert not missing, f"docs/LAYOUT.md names paths that do not exist: {missing}"
    assert not unnamed, f"docs/LAYOUT.md's tree does not name: {unnamed}"


def test_layout_problems_catch_a_planted_doc(tmp_path):
    for folder in ("minillm/core", "minillm/engines/r8_policies", "minillm/data", "tests/core"):
        (tmp_path / folder).mkdir(parents=True)
    for module in ("minillm/__init__.py", "minillm/llm.py", "minillm/chat.py",
                   "minillm/core/__init__.py", "minillm/engines/__init__.py",
                   "minillm/engines/r8_policies/__init__.py"):
        (tmp_path / module).write_text("")
    (tmp_path / "tests" / "__pycache__").mkdir()
    doc = ("# Layout\n\nThe policies: `engines/r8_policies/`, `minillm/core/policy.py`.\n\n"
           "```\n"
           "minillm/\n"
           "  __init__.py, llm.py   the public names\n"
           "  gone.py               a module that was moved\n"
           "  core/                 rung 3\n"
           "  engines/              the ladder: r8_policies/ below\n"
           "                        core/ (a description, not an entry)\n"
           "    r8_policies/        rung 8\n"
           "  data/                 not a package: may be named\n"
           "tests/\n"
           "  core/                 the core's tests\n"
           "```\n")
    assert tree_paths(doc) == ["minillm/", "minillm/__init__.py", "minillm/llm.py",
                               "minillm/gone.py", "minillm/core/", "minillm/engines/",
                               "minillm/engines/r8_policies/", "minillm/data/", "tests/",
                               "tests/core/"]
    # chat.py is not named; minillm/gone.py and the backticked core/policy.py do not exist
    assert layout_problems(doc, tmp_path) == (["minillm/core/policy.py", "minillm/gone.py"],
                                              ["minillm/chat.py"])
    (tmp_path / "tests" / "serve").mkdir()            # a new folder of tests, not in the tree
    (tmp_path / "minillm" / "core" / "policy.py").write_text("")
    assert layout_problems(doc, tmp_path) == (["minillm/gone.py"],
                                              ["minillm/chat.py", "tests/serve/"])
    named = doc.replace("  gone.py ", "  chat.py ").replace("  core/                 the core's",
                                                            "  core/, serve/         the")
    assert layout_problems(named, tmp_path) == ([], [])
