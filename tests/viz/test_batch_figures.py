"""Notebook 01's static-batch pictures and batch-size sweep (and notebook 02's join/leave trace)
are drawn from real engine runs: what they show equals what the runs recorded."""
from __future__ import annotations

import re

import numpy as np
import pytest
from matplotlib.image import AxesImage

from minillm import LLM, SamplingParams
from minillm.memory import RESERVED, TOKEN
from minillm.viz.batch_figures import (batch_size_sweep, describe_static_frames,
                                       finished_rows, fixed_length_prompts, join_leave_events,
                                       record_static_batch, static_frames_figure, sweep_figure,
                                       sweep_summary)
from minillm.viz.notebook import forward_seconds
from minillm.workload import WorkItem

MAX_TOKENS = [5, 2, 5, 5]      # prompt 3 + max 5 = rows of 8 slots; request 1 is done after 2


@pytest.fixture(scope="module")
def static4x8(tiny):
    llm = LLM(tiny, engine="static", batch_size=4)
    texts = ["The cat sat", "Once upon a time", "Paris is big", "The sun rises"]
    return record_static_batch(tiny, fixed_length_prompts(llm, texts, 3), MAX_TOKENS)


def test_the_frames_come_from_a_4x8_static_run(static4x8):
    result, view = static4x8
    assert [len(o.token_ids) for o in result.outputs] == MAX_TOKENS
    assert [s.step for s in view.snapshots] == list(range(1, max(MAX_TOKENS) + 1))
    held = [s for s in view.snapshots if s.kind.size]
    assert held and all(s.engine == "static" and s.kind.shape == (4, 8) for s in held)
    assert all(s.counts.allocated == 32 for s in held)    # reserved at step 1, kept to the end
    assert not view.snapshots[-1].kind.size               # the batch ended: every slot freed


def test_the_finished_row_stays_allocated_until_the_batch_ends(static4x8):
    result, view = static4x8
    short = result.outputs[1].request_id
    done_at = 2
    for i, snap in enumerate(view.snapshots[:-1]):
        row_owner = {snap.owners[o] for o in snap.owner[1]}
        assert row_owner == {short}, "row 1 belongs to the short request at every step"
        assert np.isin(snap.kind[1], (TOKEN, RESERVED)).all()
        expected = [1] if snap.step > done_at else []
        assert finished_rows(view, i) == expected
    tokens = [int((s.kind[1] == TOKEN).sum()) for s in view.snapshots[done_at - 1:-1]]
    assert len(set(tokens)) == 1, "a finished row's tokens neither grow nor go away"
    text = describe_static_frames(view)
    assert "4 rows x 8 slots = 32 KV slots" in text
    assert f"request {short} was done after step {done_at}" in text
    assert f"for {max(MAX_TOKENS) - 1 - done_at} more step(s)" in text


def test_the_frames_figure_draws_every_step_and_hatches_the_finished_row(static4x8):
    result, view = static4x8
    fig = static_frames_figure(view, result)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == len(view.snapshots)
    for ax, snap in zip(panels, view.snapshots):
        images = [a for a in ax.get_children() if isinstance(a, AxesImage)]
        assert images[0].get_array().shape[:2] == (4, 8)
        title = ax.get_title()
        assert title.startswith(f"step {snap.step}")
        if snap.kind.size:
            assert f"{snap.counts.token} tokens, {snap.counts.reserved} reserved" in title
        hatched = [p for p in ax.patches if p.get_hatch()]
        assert len(hatched) == (1 if snap.step in (3, 4) else 0)
        prompts = [t for t in ax.texts if t.get_text() == "P"]
        assert len(prompts) == (12 if snap.kind.size else 0)   # 4 rows x 3 prompt tokens
    assert min(t.get_fontsize() for ax in panels for t in ax.texts) >= 9


def test_fixed_length_prompts_refuses_a_text_too_short(tiny):
    with pytest.raises(ValueError, match="fewer than"):
        fixed_length_prompts(LLM(tiny, engine="static"), ["ab"], 10)


def test_the_sweep_plots_the_runs_metrics(tiny):
    items = [WorkItem({"prompt_token_ids": [1, 5 + i, 9, 13][: 2 + i % 3]},
                      SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(4)]
    points = batch_size_sweep(tiny, items, [1, 2, 4], warmup=False)
    assert [p.batch_size for p in points] == [1, 2, 4]
    for p in points:
        assert p.result.metrics.output_tokens == 12
        assert p.num_steps == (4 // p.batch_size) * 3    # batches one after another
        assert max(s.batch_size for s in p.result.steps) == p.batch_size
    tokens = [[o.token_ids for o in p.result.outputs] for p in points]
    assert tokens[0] == tokens[1] == tokens[2], "batching changed the generated tokens"
    fig = sweep_figure(points)
    ax_t, ax_s = fig.axes
    measured = ax_t.lines[0]
    assert list(measured.get_xdata()) == [1, 2, 4]
    expected = [p.result.metrics.output_tokens / forward_seconds(p.result) for p in points]
    assert np.allclose(measured.get_ydata(), expected)
    bars = [b.get_height() for b in ax_s.patches]
    full = [[s.decode_ms for s in p.result.steps if s.decode_ms and s.batch_size == p.batch_size]
            for p in points]
    assert np.allclose(bars, [sum(ms) / len(ms) for ms in full])
    summary = sweep_summary(points)
    best = max(points, key=lambda p: p.tok_s)
    assert f"best batch size was {best.batch_size}" in summary
    assert f"{points[-1].tok_s:7.1f}" in summary


def test_join_leave_events_follow_a_dynamic_run(tiny):
    from minillm.viz.live_view import LiveMemoryView
    llm = LLM(tiny, engine="dynamic", max_num_seqs=2)
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in (3, 6, 4, 1)]
    view = LiveMemoryView()
    prompts = [[1, 2, 3], [1, 4], [1, 5, 6, 7], [1, 8]]
    result = llm.run(llm.make_requests(prompts, params), on_step=view)
    events = join_leave_events(view, result)
    ids = [o.request_id for o in result.outputs]
    assert events[0] == f"step 1: request {ids[0]}, {ids[1]} joined (2 running)"

    def who(event: str, verb: str) -> list[str]:
        found = re.search(rf"request ([\w, ]+) {verb}", event)
        return found.group(1).split(", ") if found else []
    for rid in ids[:3]:      # each request joins once and leaves once, in that order
        joins = [i for i, e in enumerate(events) if rid in who(e, "joined")]
        leaves = [i for i, e in enumerate(events) if rid in who(e, "left")]
        assert len(joins) == 1 and len(leaves) == 1 and joins[0] < leaves[0]
    # a newcomer is prefilled and decoded in one step: request 0's 3 tokens come at steps 1
    # (two) and 2, it is gone after step 2, and the queue's next request takes its row at step 3
    assert events[1] == f"step 2: request {ids[0]} left (1 running)"
    assert events[2] == f"step 3: request {ids[2]} joined (2 running)"
    assert events[-1].startswith(f"request {ids[3]}: done in the step that prefilled it")
