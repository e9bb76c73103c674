"""The core is the paged engine only: small enough to read (at most CORE_MAX_LINES
lines of Python), and it names no later rung's concern in its code (comments and docstrings may
say which rung builds on what). Static: source text only; each check has a self-test."""
from __future__ import annotations

import pytest
from architecture import PKG, later_rung_names, python_lines, sources, word_parts, words_in

CORE_MAX_LINES = 2500


@pytest.fixture(scope="module")
def core() -> dict[str, str]:
    return sources(PKG / "core")


def over_budget(files: dict[str, str], limit: int = CORE_MAX_LINES) -> list[str]:
    """Lines per file, largest first, when the total is over ``limit``; [] when within it."""
    lines = python_lines(files)
    if sum(lines.values()) <= limit:
        return []
    return [f"{path}: {n}" for path, n in sorted(lines.items(), key=lambda kv: (-kv[1], kv[0]))]


def test_core_is_at_most_2500_lines(core):
    total = sum(python_lines(core).values())
    per_file = over_budget(core)
    print(f"minillm/core/: {total} lines\n  " + "\n  ".join(per_file))
    assert not per_file, (f"minillm/core/ has {total} lines, over {CORE_MAX_LINES}:\n  "
                          + "\n  ".join(per_file))


def test_self_test_line_budget():
    files = {"minillm/core/a.py": "x = 1\n" * 3, "minillm/core/b.py": "y = 2\n" * 5}
    assert over_budget(files, limit=8) == []
    assert over_budget(files, limit=7) == ["minillm/core/b.py: 5", "minillm/core/a.py: 3"]


def test_core_names_no_later_rung(core):
    bad = later_rung_names(core)
    print("\n  " + "\n  ".join(bad))
    assert bad == [], "later rungs' names in minillm/core/:\n  " + "\n  ".join(bad)


def test_self_test_word_parts_not_substrings():
    assert word_parts("slo_ttft_ms") == ["slo", "ttft", "ms"]
    assert word_parts("LoRAConfig") == ["lo", "ra", "config"]
    assert word_parts("--async-scheduling") == ["async", "scheduling"]
    for hit, word in [("slo_ttft_ms", "slo"), ("SLO_FIELDS", "slo"), ("async_scheduling", "async"),
                      ("LoRAConfig", "lora"), ("lora", "lora"), ("SLOConfig", "slo"),
                      ("isAsync", "async"), ("TPOTController", "tpot"), ("tpot", "tpot"),
                      ("PipelineEngine", "pipeline"), ("disagg_link", "disagg"),
                      ("--speculative-model", "speculative"), ("minillm.engines.r7_pipeline",
                                                               "pipeline")]:
        assert words_in(hit) == [word], hit
    for miss in ("slot", "slots", "SLOTS", "slot_mapping", "asyncio", "pipelined", "Lorax",
                 "disaggregated", "tpots", "speculatively", "self"):
        assert words_in(miss) == [], miss


def test_self_test_planted_core_source():
    planted = {"minillm/core/x.py": "def f(slo_ttft_ms):\n    x.async_scheduling\n"}
    assert later_rung_names(planted) == ["minillm/core/x.py:1 slo_ttft_ms [slo]",
                                         "minillm/core/x.py:2 async_scheduling [async]"]
    assert later_rung_names({"minillm/core/y.py": "slots = 1\n"}) == []


def test_self_test_code_not_prose():
    """Names, attributes, classes, keywords, imports, option-name strings and f-string fields are
    code; comments, docstrings and prose strings are not."""
    planted = {"minillm/core/z.py": (
        '"""Rung 6 (speculative) and rung 13 (LoRA) build on this."""\n'   # 1 docstring: fine
        "import asyncio  # rung 12's async scheduling lives elsewhere\n"     # 2 comment: fine
        "class LoRAConfig:\n"                                                 # 3
        "    '''For the pipeline.'''\n"                                       # 4 docstring: fine
        "    def f(self, *, slots=1):\n"                                      # 5
        "        g(tpot=2)\n"                                                 # 6
        "        raise ValueError('slo is not a core policy')\n"              # 7 prose: fine
        "        return {'disagg': 1, '--speculative-model': 2}\n"           # 8
        "async def h(): pass\n"                                               # 9
        "from .pipeline_stage import Stage as S\n"                            # 10
        "y = f'{SLO_MS}: ms'\n")}                                             # 11
    assert later_rung_names(planted) == [
        "minillm/core/z.py:3 LoRAConfig [lora]",
        "minillm/core/z.py:6 tpot [tpot]",
        "minillm/core/z.py:8 --speculative-model [speculative]",
        "minillm/core/z.py:8 disagg [disagg]",
        "minillm/core/z.py:9 async [async]",
        "minillm/core/z.py:10 pipeline_stage [pipeline]",
        "minillm/core/z.py:11 SLO_MS [slo]"]
