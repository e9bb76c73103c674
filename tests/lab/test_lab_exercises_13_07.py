"""Exercises 07 (pipeline stages), 13 (the multi-LoRA gather matmuls) and 13-slots (the adapter
slots), and the two contracts exercises 12 and 12-async now hold: each grader passes the package's
own code, fails the blank skeleton, and fails every plausible wrong solution below with a message
that names the mistake."""
from __future__ import annotations

import pytest

from minillm.lab.exercises import EXERCISES
from labtools import assert_grader_judges

# Exercise 12-async: an abort that lands with the step in flight but is reported by the next
# step's output (the deferred abort put with the aborts of the next step). Since the core's
# redesign the step loop is not the student's, so the mistake is planted by patching it from
# the student's file; the grader counted finals per request and accepted it.
EXECUTOR_END = ('        return {"async_scheduling": True, "overlap": self.overlap.as_dict()}\n')
LATE_ABORT = """

def _apply_deferred_aborts(self, out):
    waiting, self.deferred_aborts = self.deferred_aborts, []
    for request_id in waiting:
        self.abort(request_id)          # ended now, reported by the next step (self.aborted)


from ...core.engine import PagedEngine as _PagedEngine  # noqa: E402

_PagedEngine._apply_deferred_aborts = _apply_deferred_aborts
"""

# (text in the reference, what a student writes instead, what the grader's message must say)
MISTAKES = {
    "07": [
        ("        end = start + base + (1 if r < extra else 0)",      # the remainder lost
         "        end = start + base", "are on no rank"),
        ("        end = start + base + (1 if r < extra else 0)",      # the last ranks take them
         "        end = start + base + (1 if r >= world_size - extra else 0)",
         "the earlier ranks take the extra layers"),
        ("    base, extra = divmod(num_layers, world_size)",          # every slice rounded up
         "    base, extra = -(-num_layers // world_size), 0", "past the model's"),
        ("        bounds.append((start, end))",                       # inclusive bounds
         "        bounds.append((start, end - 1))", "the bounds are [start, end)"),
        ("        elif out.shape[0] and comm.rank != 0:",             # empty logits sent too
         "        else:", "no row to sample"),
        ("        if not self.is_last:\n            comm.isend(out, comm.rank + 1)\n"
         "        elif out.shape[0] and comm.rank != 0:\n            comm.isend(out, 0)",
         "        comm.isend(out, comm.rank + 1)",                     # the last sends onward
         "there is no rank after it"),
        ("        self.copy_blocks(inputs.copies)\n", "",               # no copy-on-write
         "copy-on-write copies"),
        ("        return self.net.logits(self.net.final_hidden(h)[idx])",   # every row's logits
         "        return self.net.logits(self.net.final_hidden(h))", "logits of inputs.logit_rows"),
        ("        if not inputs.logit_rows:\n"                           # no rows: not handled
         "            return h.new_empty((0, self.net.vocab_size), dtype=torch.float32)\n", "",
         "[0, vocab] float32"),
    ],
    "13": [
        ("        xa = x.index_select(0, rows) @ A[slot].T",           # A not transposed
         "        xa = x.index_select(0, rows) @ A[slot]", "the shrink to the rank first"),
        ("torch.bmm(B[s], xa)", "torch.bmm(B[s].transpose(1, 2), xa)",   # B transposed
         "the shrink to the rank first"),
        ("    for slot, rows in segments:\n",                       # slots taken as 1-based
         "    for slot, rows in segments:\n        slot = slot - 1\n", "delta: the indices"),
        ("r, s = rows[i:i + BGMV_CHUNK], idx[i:i + BGMV_CHUNK]",     # a row's neighbour's slot
         "r, s = rows[i:i + BGMV_CHUNK], idx[i:i + BGMV_CHUNK].roll(1)", "delta: the indices"),
        ("        y.index_add_(0, rows, xa @ B[slot].T)",             # the base product lost
         "        y[rows] = xa @ B[slot].T", "add the delta to it"),
        ("        y.index_add_(0, r, torch.bmm(B[s], xa).squeeze(-1))",      # not in place
         "        y = y.index_add(0, r, torch.bmm(B[s], xa).squeeze(-1))", "in place"),
        ("r, s = rows[i:i + BGMV_CHUNK], idx[i:i + BGMV_CHUNK]",     # each chunk's last row lost
         "r, s = rows[i:i + BGMV_CHUNK - 1], idx[i:i + BGMV_CHUNK - 1]", "got no delta"),
        ("        y.index_add_(0, r, torch.bmm(B[s], xa).squeeze(-1))",      # rows by position
         "        y[i:i + len(r)] += torch.bmm(B[s], xa).squeeze(-1)", "touch only the rows"),
    ],
    "13-slots": [
        ("copy_(b * adapter.scale)", "copy_(b)", "not scale * B"),      # alpha / r forgotten
        ("victim = next((n for n in self.lru if n not in busy), None)",   # a busy slot evicted
         "victim = next(iter(self.lru), None)", "which a running request uses"),
        ("victim = next((n for n in self.lru if n not in busy), None)",   # MRU evicted
         "victim = next((n for n in reversed(self.lru) if n not in busy), None)",
         "you evicted the most recently used"),
        ("            self.lru.move_to_end(adapter.name)\n", "",     # a hit is not a use
         "a hit is a use"),
        ("        for key in self.A:\n            self.A[key][row].zero_()\n"
         "            self.B[key][row].zero_()\n", "", "left behind"),  # stale weights kept
        ("r, row = adapter.rank, slot - 1", "r, row = adapter.rank, slot",   # slot s in row s
         "slot s is row s - 1"),
        ("victim = next((n for n in self.lru if n not in busy), None)",   # never evicts
         "victim = None", "would wait for nothing"),
        ("        for m in TARGETS:\n            self.live[m].discard(slot)\n", "",
         "live[m] holds exactly"),                                 # live keeps evicted slots
    ],
    # The contracts the graders of 12 and 12-async did not check before (issue 57): each of
    # these passed them.
    "12": [
        ("        if num_tokens <= 0 or not math.isfinite(step_ms) or step_ms < 0:\n"
         "            return None\n", "", "a step of no tokens"),       # every step folded in
        ("        if num_tokens <= 0 or not math.isfinite(step_ms) or step_ms < 0:\n",
         "        if num_tokens <= 0:\n", "a negative time"),           # only idle steps ignored
        ("        if num_tokens <= 0 or not math.isfinite(step_ms) or step_ms < 0:\n",
         "        if num_tokens <= 0 or step_ms < 0:\n", "NaN"),         # NaN folded in
    ],
    "12-async": [(EXECUTOR_END, EXECUTOR_END + LATE_ABORT, "not a later one")],
}


def reference(ex_id: str) -> str:
    return EXERCISES[ex_id].source_path.read_text()


def test_every_mistake_still_applies():
    for ex_id, mistakes in MISTAKES.items():
        source = reference(ex_id)
        for old, new, _ in mistakes:
            assert old in source, (ex_id, new)


@pytest.mark.slow
@pytest.mark.parametrize("ex_id", list(MISTAKES))
def test_grader_passes_the_reference_and_names_each_mistake(ex_id, tmp_path):
    assert_grader_judges(ex_id, MISTAKES[ex_id], tmp_path)


def test_questions_07_and_13():
    """07.q1's truth is split_layers' definition (a handout stubs split_layers): it agrees with a
    run of the package's own code, on the question's numbers and others; 13.q1 is rsLoRA's."""
    from minillm.lab import questions as q
    for args in ((), (2, 3), (7, 7), (5, 1), (0, 3), (31, 4), (29, 8)):
        assert q.stage_layers_by_definition(*args) == q.stage_layers(*args), args
    assert q.is_right("07.q1", (8, 7)) and not q.is_right("07.q1", (7, 8))
    assert q.is_right("13.q1", 8) and not q.is_right("13.q1", 2)      # 32 / sqrt(16), not / 16


def test_the_new_exercises_are_listed_with_their_graders():
    for ex_id in ("07", "13", "13-slots"):
        ex = EXERCISES[ex_id]
        assert ex.grader.exists() and ex.notebook[:2] == ex_id[:2]
        assert f"python -m minillm.lab start {ex_id}" in _notebook_text(ex.notebook)


def _notebook_text(name: str) -> str:
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "notebooks" / f"{name}.ipynb"
    return "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
