"""Notebook 13's pictures: the adapter-slot figure's legend is true (every colour drawn is named,
an empty slot included), and the live view leaves a picture that a page without a kernel shows
(plain ``jupyter nbconvert`` HTML), hidden beside the live widget."""
from __future__ import annotations

import base64
import re

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.colors import to_rgba  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.viz.live_view import LIVE_CLASS, STATIC_CLASS, LiveMemoryView  # noqa: E402
from minillm.viz.lora_figures import slot_figure  # noqa: E402

ADAPTERS = ["attn-r4", "mlp-r8", "all-r16"]
TRACE = [(1, [None, None]), (2, ["attn-r4", None]), (3, ["attn-r4", "all-r16"]),
         (4, ["mlp-r8", "all-r16"]), (5, [None, "all-r16"])]


def test_each_cell_has_the_colour_its_legend_entry_names():
    ax = slot_figure(TRACE, ADAPTERS).axes[0]
    legend = {t.get_text(): to_rgba(h.get_facecolor())
              for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)}
    assert list(legend) == ["empty", *ADAPTERS]
    assert len(set(legend.values())) == len(legend)          # no two entries share a colour
    image = ax.images[0]
    drawn = image.to_rgba(image.get_array())                  # [slot, step] -> RGBA
    for col, (_, slots) in enumerate(TRACE):
        for row, name in enumerate(slots):
            assert tuple(drawn[row, col]) == pytest.approx(legend[name or "empty"]), (row, col)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["slot 1", "slot 2"]


def test_an_adapter_the_legend_does_not_know_is_an_error():
    with pytest.raises(ValueError, match=r"adapters \['other'\] are not among"):
        slot_figure([(1, ["other", None])], ADAPTERS)


@pytest.fixture(scope="module")
def watched(tiny):
    view = LiveMemoryView(title="a <tiny> run")
    llm = LLM(tiny, engine="paged")
    llm.run(llm.make_requests([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=6, ignore_eos=True)),
            on_step=view)
    return view


def test_finish_leaves_the_last_frame_as_a_picture_hidden_beside_the_live_widget(watched,
                                                                                  monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    assert watched.finish() is watched
    [static] = shown
    bundle = static._repr_mimebundle_()
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    html = bundle["text/html"]
    img = re.search(r'<img class="(\S+)" alt="([^"]*)" src="data:image/png;base64,(\S+)">', html)
    assert img and img.group(1) == STATIC_CLASS and img.group(3) == bundle["image/png"]
    assert "&lt;tiny&gt;" in img.group(2)                     # the title, escaped
    # the rule that hides it where the live widget (its image has LIVE_CLASS) is drawn
    assert f".jp-OutputArea:has(.{LIVE_CLASS}) .{STATIC_CLASS}" in html and "display: none" in html


@pytest.mark.parametrize("quick", ["", "1"])
def test_frames_drawn_as_the_run_goes_but_in_quick_mode_the_last_only_once(tiny, monkeypatch,
                                                                            quick):
    """Each step draws its frame (``min_interval_s=0``), then ``finish`` draws the last busy one
    once for both the static picture and the widget; quick mode (the tests' notebooks) draws only
    that last one."""
    monkeypatch.setenv("MINILLM_QUICK", quick)
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: None)
    view = LiveMemoryView(min_interval_s=0)
    view.widget()                                   # the live widget, as display(view) makes it
    drawn, figure = [], view.figure
    monkeypatch.setattr(view, "figure", lambda i=None, fig=None: drawn.append(i) or figure(i, fig))
    llm = LLM(tiny, engine="paged")
    view.watch(llm, llm.make_requests([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=4,
                                                                         ignore_eos=True)))
    last, steps = view.last_busy(), len(view.snapshots)
    assert last < steps - 1, "the run's last step holds no KV: its last busy frame is earlier"
    assert drawn == ([last] if quick else [*range(steps), last]), drawn
    status, image, slider = view.widget().children
    assert image.value == view.static_figure().png and slider.value == last


@pytest.mark.slow
def test_plain_nbconvert_html_shows_the_live_view_s_picture(tmp_path):
    """``jupyter nbconvert --execute --to html`` with no minillm export settings: the live view's
    last frame is an image in the page (the widget itself needs a kernel to draw)."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    from test_notebooks import python_kernel

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from IPython.display import display\n"
        "from minillm import LLM, SamplingParams\n"
        "from minillm.viz.live_view import LiveMemoryView\n"
        "llm = LLM('tiny-llama', engine='paged')\n"
        "view = LiveMemoryView(title='plain export')\n"
        "display(view)\n"
        "llm.run(llm.make_requests([[5, 6, 7]] * 2, SamplingParams(max_tokens=4)), on_step=view)\n"
        "view.finish();")])
    NotebookClient(nb, kernel_name=python_kernel(), timeout=300).execute()
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    img = re.search(rf'<img [^>]*class="{STATIC_CLASS}"[^>]*>', body)    # attributes reordered
    assert img and re.search(r'alt="plain export: KV memory at step \d+"', img.group(0))
    assert 'src="data:image/png;base64,' in img.group(0)
