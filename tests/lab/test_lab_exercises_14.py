"""Exercises 14 (int8 weights: quantize_per_channel, Int8Linear.__call__) and 14-buckets (the
bucket a compiled decode step is padded to): each grader passes the package's own code, fails the
blank skeleton, and fails every plausible wrong solution below with a message that names the
mistake."""
from __future__ import annotations

import pytest
import torch

from minillm.lab.exercises import EXERCISES
from labtools import assert_grader_judges

SCALE = "    scale = w.abs().amax(dim=1) / QMAX\n"
GUARD = "    scale = torch.where(scale > 0, scale, torch.ones_like(scale))\n"
CODES = "    q = torch.round(w / scale[:, None])"
PRODUCT = "            y = F.linear(x, q.to(x.dtype)) * scale"
RETURN = "        return y if residual is None else residual + y\n\n\nclass W8A8Linear"
BUCKET = "    return next((b for b in buckets if b >= n), None)"
ITEM_CHECK = "        if not item.isdigit() or int(item) < 1:"
NO_ROWS = ("    if n < 1:\n"
           '        raise ValueError(f"a decode step has at least one row, got {n}")\n')

# (text in the reference, what a student writes instead, what the grader's message must say).
# Not here, because no value can show it: the clamp to [-127, 127] left out. With s = max / 127
# no code rounds past 127, so the clamp only guards float rounding; a wrong qmax (128) is caught
# by its scale.
MISTAKES = {
    "14": [
        (SCALE, "    scale = w.abs().amax().repeat(w.shape[0]) / QMAX\n",     # one per tensor
         "every row got the same scale"),
        (SCALE, "    scale = w.abs().amax(dim=1) / 128\n", "divide by 127"),   # int8 has -128...
        (CODES, "    q = (w / scale[:, None])", "truncated toward zero"),     # .to(int8) truncates
        (SCALE + GUARD + CODES,                                             # per input column
         SCALE.replace("dim=1", "dim=0") + GUARD + CODES.replace("[:, None]", "[None, :]"),
         "one per input column"),
        (GUARD, "", "an all-zero row gets scale 1"),                        # 0 / 0: NaN codes
        (PRODUCT, "            y = F.linear(x, q.to(x.dtype) * scale[None, :])",   # wrong axis
         "s scaled q's columns"),
        (PRODUCT, "            y = F.linear(x, q.float()) * scale",         # widened to fp32
         "x's dtype"),
        (RETURN, RETURN.replace("y if residual is None else residual + y", "y"),
         "the residual is missing"),
        ("        path = self.path or int8_path(x.device, x.dtype, x.numel() // max(x.shape[-1], 1))"
         "\n",                                                          # never the int8 op
         '        path = "dequant"\n', "_weight_int8pack_mm"),
    ],
    "14-buckets": [
        (BUCKET, "    return next((b for b in reversed(buckets) if b <= n), None)",  # floor
         "a bucket smaller than the batch"),
        (BUCKET, "    import bisect\n    i = bisect.bisect_right(buckets, n)\n"    # off by one
         "    return buckets[i] if i < len(buckets) else None", "bisect_left"),
        (BUCKET, "    return buckets[-1] if n <= buckets[-1] else None",      # always the largest
         "the largest bucket is not the smallest"),
        (BUCKET, "    return next((b for b in buckets if b >= n), buckets[-1])",   # never None
         "return None (that step runs eagerly)"),
        (NO_ROWS, "", "raise ValueError for n < 1"),                       # 0 rows: bucket 1
        ("int(item) < 1:", "int(item) < 0:", "positive integer"),           # 0 accepted
        ("int(item) <= out[-1]:", "int(item) < out[-1]:", "must increase"),   # "2,2" accepted
        (ITEM_CHECK, "        if int(item) < 1:", "must name the option"),   # int()'s error
        ("    if text is None:\n        return DEFAULT_BUCKETS\n", "", "DEFAULT_BUCKETS"),
    ],
}


def int8pack_runs_here() -> bool:
    """The grader tests the int8pack path only where the op answers (as it does here)."""
    try:
        torch.ops.aten._weight_int8pack_mm(torch.ones(1, 8), torch.ones(2, 8, dtype=torch.int8),
                                           torch.ones(2))
        return True
    except Exception:            # noqa: BLE001 - an op this torch build lacks
        return False


def reference(ex_id: str) -> str:
    return EXERCISES[ex_id].source_path.read_text()


def test_every_mistake_still_applies_once():
    for ex_id, mistakes in MISTAKES.items():
        source = reference(ex_id)
        for old, new, _ in mistakes:
            assert source.count(old) == 1, (ex_id, old)


@pytest.mark.slow
@pytest.mark.parametrize("ex_id", list(MISTAKES))
def test_grader_passes_the_reference_and_names_each_mistake(ex_id, tmp_path):
    """The int8pack path is graded only where torch has the op (as it does here)."""
    mistakes = [m for m in MISTAKES[ex_id]
                if m[2] != "_weight_int8pack_mm" or int8pack_runs_here()]
    assert_grader_judges(ex_id, mistakes, tmp_path)


def test_the_exercises_are_listed_with_their_graders_and_notebook():
    from pathlib import Path
    for ex_id in MISTAKES:
        ex = EXERCISES[ex_id]
        assert ex.grader.exists() and ex.notebook == "14_compiled"
        notebook = Path(__file__).resolve().parents[2] / "notebooks" / f"{ex.notebook}.ipynb"
        if not notebook.exists():
            pytest.skip(f"notebooks/{ex.notebook}.ipynb is not written yet")
        text = _notebook_text(notebook)      # the full command, or `start ID` after it
        assert "python -m minillm.lab start 14" in text and (
            f"python -m minillm.lab start {ex_id}`" in text or f"`start {ex_id}`" in text), \
            f"notebook {ex.notebook} does not tell students to start exercise {ex_id}"


def _notebook_text(path) -> str:
    import json
    return "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
