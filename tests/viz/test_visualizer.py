"""``FragmentationVisualizer``'s drawing schedule, without a browser: time changes from the widgets
are coalesced into few renders, always ending on the newest step; ▶ is paced to the render time;
■ leaves no backlog; and direct use (no event loop) still draws at once.

Renders run in a worker thread and are shown on the event loop, so every scenario runs inside
``asyncio.run`` and waits (a bounded number of loop turns) until no frame is pending or in flight.
Nothing here asserts on wall-clock time."""
from __future__ import annotations

import asyncio
import itertools

import pytest

pytest.importorskip("ipywidgets")

from minillm.viz import frames as vis
from minillm.viz.visualizer import FragmentationVisualizer, scratch_dir
from minillm.workload import WorkloadSpec


@pytest.fixture(scope="module")
def viz():
    v = FragmentationVisualizer(WorkloadSpec(num_requests=8, arrival_rate=1.0, output_len=(8, 64)))
    v.widget()
    assert v.num_steps > 10 and v.drawn_t == 0 and v.draw_count == 1
    return v


async def until_idle(viz, max_turns: int = 6000) -> None:
    """Turn the event loop until no draw is scheduled or rendering (at most ``max_turns``)."""
    for _ in range(max_turns):
        if viz._pending is None and not viz._busy:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"a frame was still pending after {max_turns} turns of the event loop")


def counts(viz) -> tuple[int, int]:
    return viz.render_count, viz.draw_count


def test_fifty_time_changes_in_a_row_cost_one_render_of_the_newest_step(viz):
    time_slider, top = viz._ui["time"], viz._ui["time"].max
    values = [1 + (i * 7) % top for i in range(50)]   # 50 changes, as a backlog of ▶ ticks sends
    values[-1] = top                                  # the newest: a step never drawn before

    async def scenario():
        renders, shown = counts(viz)
        for v in values:
            time_slider.value = v
        assert counts(viz) == (renders, shown), "a time change drew at once inside an event loop"
        await until_idle(viz)
        return viz.render_count - renders, viz.draw_count - shown

    assert asyncio.run(scenario()) == (1, 1)
    assert viz.t == viz.drawn_t == top == viz._ui["time"].value


def test_changes_during_a_render_cost_one_more_render_and_end_on_the_newest_step(viz):
    time_slider = viz._ui["time"]

    async def scenario():
        renders, _ = counts(viz)
        time_slider.value = 2
        await asyncio.sleep(0)             # the draw starts: step 2 renders in the worker thread
        assert viz._busy, "no frame in flight"
        for v in range(3, 3 + 49):         # 49 more changes while it renders
            time_slider.value = 1 + v % time_slider.max
        await until_idle(viz)
        return viz.render_count - renders

    assert asyncio.run(scenario()) == 2, "the changes during a render were not coalesced into one"
    assert viz.drawn_t == viz.t == time_slider.value


def test_stop_leaves_no_backlog(viz):
    play, time_slider = viz._ui["play"], viz._ui["time"]
    for step in (0, 1):                    # step 0 was drawn (and kept) before; the picture at 1
        time_slider.value = step           # (no event loop: drawn at once)
    assert viz.drawn_t == 1

    async def scenario():
        play.playing = True
        time_slider.value = 5
        await asyncio.sleep(0)             # step 5 renders
        for v in range(6, 12):             # ticks that come while it renders
            time_slider.value = v
        renders, shown = counts(viz)
        play.playing = False               # ■ sends playing=False, then, in a later message,
        await asyncio.sleep(0)             # the slider back to its minimum
        time_slider.value = 0
        await until_idle(viz)
        return viz.render_count - renders, viz.draw_count - shown

    renders, shown = asyncio.run(scenario())
    assert renders == 1, "after ■, frames of the backlog were rendered"   # only step 5's, in flight
    assert shown == 1 and viz.drawn_t == 0 == time_slider.value, \
        "after ■ the picture must go straight to where the slider rests"


def test_pause_shows_the_step_the_slider_rests_on(viz):
    play, time_slider = viz._ui["play"], viz._ui["time"]

    async def scenario():
        play.playing = True
        time_slider.value = 3
        await asyncio.sleep(0)
        time_slider.value = 4              # the last tick before pause
        play.playing = False
        await until_idle(viz)

    asyncio.run(scenario())
    assert viz.drawn_t == 4 == time_slider.value


def test_without_an_event_loop_every_change_draws_at_once(viz):
    renders, shown = counts(viz)
    viz._frames.clear()
    viz._ui["time"].value = 3
    assert counts(viz) == (renders + 1, shown + 1) and viz.drawn_t == 3
    viz.t = 5
    viz.redraw()                           # the notebooks' direct use
    assert counts(viz) == (renders + 2, shown + 2) and viz.drawn_t == 5
    assert viz.figure(2) is not None       # a figure of any step; the widget is left alone
    assert viz.drawn_t == 5 and viz.draw_count == shown + 2


def test_play_is_paced_to_the_render_time(viz):
    clock = itertools.count(0.0, 0.5)      # a fake clock: every reading 0.5 s after the last
    viz._clock = lambda: next(clock)
    try:
        viz._frames.clear()
        # the pace earlier tests' real renders left behind depends on the machine's load: start
        # from the fastest pace, so only the fake clock decides what this test reads
        viz._ui["play"].interval = vis.PLAY_MIN_INTERVAL_MS
        viz.t = 4
        viz.redraw()
        assert viz.last_draw_s == pytest.approx(0.5)
        assert viz._ui["play"].interval == viz.play_interval_ms() == 650
        viz._clock = lambda: 0.0           # instant renders: back to the fastest pace
        viz.t = 6
        viz.redraw()
        assert viz._ui["play"].interval == vis.PLAY_MIN_INTERVAL_MS
    finally:
        viz._clock = vis.time.perf_counter


def test_traces_go_to_a_per_user_temporary_folder():
    path = scratch_dir()
    assert path.is_dir() and path.name.startswith("minillm-") and len(path.name) > len("minillm-")
