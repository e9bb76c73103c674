"""Links into a heading of a markdown file (``RESULTS.md#some-heading``) land on a heading that
exists: the anchor is the one GitHub makes from the heading's text. (``test_layout.py`` checks
that the linked files exist.)"""
from __future__ import annotations

import re
from pathlib import Path

from test_layout import FENCE, LINK, ROOT, markdown_files

HEADING = re.compile(r"^#{1,6}[ \t]+(.*?)[ \t#]*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline markup and punctuation dropped (word
    characters, hyphens and spaces kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)       # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    out, seen = set(), {}
    for heading in HEADING.findall(FENCE.sub("", text)):
        s = slug(heading)
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return out


def dead_anchors(text: str, path: Path) -> list[str]:
    """The links in markdown ``text`` (the file ``path``) whose anchor names no heading of the
    markdown file they point to (same-page anchors included); links in code are not links."""
    text = re.sub(r"`[^`\n]*`", "``", FENCE.sub("", text))
    dead = []
    for target in LINK.findall(text):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or "#" not in target:
            continue
        file, anchor = target.split("#", 1)
        linked = path.parent / file if file else path
        if linked.suffix == ".md" and linked.exists() and anchor not in anchors(linked.read_text()):
            dead.append(target)
    return dead


def test_every_anchor_in_readme_and_docs_names_a_heading():
    dead = {str(p.relative_to(ROOT)): d for p in markdown_files()
            if (d := dead_anchors(p.read_text(), p))}
    assert not dead, f"links to headings that do not exist: {dead}"


def test_dead_anchors_catches_a_planted_dead_anchor(tmp_path):
    (tmp_path / "R.md").write_text("# Results\n## On a lent GPU: an H200 (2026-11-26)\n"
                                   "## `bf16` on this CPU\n## Notes\n## Notes\n"
                                   "```\n# not a heading\n```\n")
    page = tmp_path / "P.md"
    text = ("[ok](R.md#on-a-lent-gpu-an-h200-2026-11-26) [ok](R.md#bf16-on-this-cpu) "
            "[second](R.md#notes-1) [file only](R.md) [web](https://x.org/a.md#b)\n"
            "[old](R.md#on-a-lent-gpu-an-h200-once) [fenced](R.md#not-a-heading) "
            "[here](#nowhere) `[code](R.md#nowhere)`\n")
    page.write_text(text)
    assert dead_anchors(text, page) == ["R.md#on-a-lent-gpu-an-h200-once",
                                        "R.md#not-a-heading", "#nowhere"]
