"""What the README's snippets show is what they do: the finish reason prints as ``length``, and
the example ``in.jsonl`` is what ``generate --prompts`` accepts."""
from __future__ import annotations

import re
from pathlib import Path

from minillm import FinishReason
from minillm.jsonl import read_lines

README = Path(__file__).resolve().parents[2] / "README.md"


def test_a_finish_reason_prints_as_its_value(capsys):
    print(FinishReason.LENGTH, f"{FinishReason.STOP}")
    assert capsys.readouterr().out == "length stop\n"
    assert "outs[0].finish_reason)" in README.read_text()


def test_the_readme_s_in_jsonl_is_accepted_line_by_line(tmp_path):
    heredoc = re.search(r"cat > in\.jsonl <<'EOF'\n(.*?)\nEOF\n", README.read_text(), re.S)
    assert heredoc, "the README shows what in.jsonl looks like"
    (tmp_path / "in.jsonl").write_text(heredoc.group(1) + "\n")
    lines = read_lines(str(tmp_path / "in.jsonl"), {"max_tokens": 64})
    assert len(lines) >= 2 and [ln.error for ln in lines] == [None] * len(lines)
    assert {next(iter(ln.spec[0])) for ln in lines} >= {"messages", "prompt"}
