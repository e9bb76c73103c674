"""Notebook 03's pictures (minillm/viz/block_figures.py, schedule_figures.py) show what the real block manager and the
real paged engine did: words in the physical slots the block tables point to, the block that
copy-on-write copied into, bar heights equal to the StepRecords, preemption marks where the
engine counted a preemption."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.text import Annotation

from minillm import LLM, SamplingParams
from minillm.core.block_manager import BlockManager
from minillm.core.sequence import Sequence
from minillm.request import Request
from minillm.viz import schedule_figures
from minillm.viz.block_figures import (beam_refcount_figure, block_table_figure, capture,
                                       frames_figure, prefix_cache_figure, ref_history)
from minillm.viz.schedule_figures import prefill_decode_figure, priority_figure, run_by_steps
from minillm.viz.live_view import LiveMemoryView
from minillm.viz.plots import request_timeline


# --- the by-hand block manager of notebook 03 --------------------------------------------
class Words:
    """One made-up token id per word, as the notebook's by-hand cell does."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def ids(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab) + 10) for w in text.split()]

    def seq(self, text: str) -> Sequence:
        t = self.ids(text)
        return Sequence(Request(t, request_id=text.split()[0]), list(t), len(t))

    def __call__(self, tok: int) -> str:
        return {i: w for w, i in self.vocab.items()}[tok]


def compute(bm: BlockManager, seq: Sequence) -> list[tuple[int, int]]:
    n = seq.num_uncomputed
    copies = bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)
    return copies


@pytest.fixture
def paper():
    words = Words()
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    a, b = words.seq("Four score and seven years ago our"), words.seq("you only live")
    compute(bm, a), compute(bm, b)
    return bm, {"a": a, "b": b}, words


def texts_by_gid(ax, prefix: str) -> dict[str, str]:
    return {t.get_gid(): getattr(t, "word", t.get_text()) for t in ax.texts
            if (t.get_gid() or "").startswith(prefix)}


def expected_slots(bm: BlockManager, seqs: dict[str, Sequence], words) -> dict[str, str]:
    """Where each computed token lives, from the block tables: block table[p // bs], slot p % bs."""
    bs, out = bm.block_size, {}
    for s in seqs.values():
        for p in range(s.num_computed_tokens):
            out[f"phys:{s.block_table[p // bs]}:{p % bs}"] = words(s.token_ids[p])
    return out


def test_block_table_figure_puts_each_word_in_its_physical_slot(paper):
    bm, seqs, words = paper
    fig = block_table_figure(bm, seqs, words)
    ax = fig.axes[0]
    assert texts_by_gid(ax, "phys:") == expected_slots(bm, seqs, words)
    assert texts_by_gid(ax, "phys:")["phys:1:2"] == "our"   # "years ago our _" in block 1
    logical = texts_by_gid(ax, "log:")
    assert logical["log:a:1:0"] == "years" and logical["log:b:0:2"] == "live"
    assert len(logical) == sum(s.num_computed_tokens for s in seqs.values())
    refs = texts_by_gid(ax, "ref:")
    assert refs == {f"ref:{b.block_id}": f"ref {b.ref_count}" for b in bm.blocks}
    arrows = [t for t in ax.texts if isinstance(t, Annotation)]
    assert len(arrows) == sum(len(s.block_table) for s in seqs.values())
    assert all(t.get_fontsize() >= 9 for t in ax.texts)


def test_frames_show_fork_copy_on_write_and_free(paper):
    bm, seqs, words = paper
    a = seqs["a"]
    frames = [capture(bm, seqs, "a and b")]
    c = bm.fork(a)
    frames.append(capture(bm, {**seqs, "c": c}, "fork"))
    c.token_ids += words.ids("fathers")
    copies = compute(bm, c)
    assert len(copies) == 1                       # c wrote into the block it shared with a
    frames.append(capture(bm, {**seqs, "c": c}, "append to c", copies))
    bm.free(a)
    frames.append(capture(bm, {"b": seqs["b"], "c": c}, "free(a)"))
    fig = frames_figure(frames, words)
    axes = fig.axes[:len(frames)]
    copied = [[p.get_gid() for p in ax.patches if (p.get_gid() or "").startswith("copied:")]
              for ax in axes]
    src, dst = copies[0]
    assert copied == [[], [], [f"copied:{dst}"], []]
    cow = texts_by_gid(axes[2], "phys:")
    assert cow[f"phys:{dst}:3"] == "fathers" and f"phys:{src}:3" not in cow
    # each frame was captured when it happened: the fork's ref counts survive the later free
    assert texts_by_gid(axes[1], "ref:")[f"ref:{src}"] == "ref 2"
    assert texts_by_gid(axes[3], "ref:")["ref:0"] == "ref 1"      # only c holds block 0 now


# --- engine runs on the tiny model ----------------------------------------------------------------
def prompt(n: int, start: int = 5) -> list[int]:
    return [start + i % 50 for i in range(n)]


def test_beam_refcount_figure_counts_the_engines_ref_counts(tiny):
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=40)
    view = LiveMemoryView()
    llm.run(llm.make_requests([prompt(10)], SamplingParams(beam_width=3, max_tokens=8)),
            on_step=view)
    steps, ref, freed = ref_history(view.snapshots)
    for snap, r in zip(view.snapshots, ref):   # a ref count = how many block tables list the block
        tables = [b for t in snap.extra["block_tables"].values() for b in t]
        assert list(r) == [tables.count(b) for b in range(len(r))]
    assert (ref >= 3).any() and freed[-1].sum() == (ref[-2] > 0).sum()   # the end frees it all
    fig = beam_refcount_figure(view.snapshots)
    ax_h, ax_b = fig.axes[:2]
    bars = {c.get_label(): [p.get_height() for p in c] for c in ax_b.containers}
    assert bars["ref count 1"] == list((ref == 1).sum(1))
    assert bars["ref count 3+"] == list((ref >= 3).sum(1))
    assert bars["freed this step (ref count → 0)"] == list(-freed.sum(1))
    marks = {t.get_gid() for t in ax_h.texts if (t.get_gid() or "").startswith("freed:")}
    assert marks == {f"freed:{steps[t]}:{b}" for t, b in zip(*np.nonzero(freed))}


def test_prefix_cache_figure_shows_cached_blocks_taken_back(tiny):
    llm = LLM(tiny, engine="paged", block_size=4, enable_prefix_caching=True, max_num_seqs=1)
    view = LiveMemoryView()
    system = prompt(24)
    reqs = llm.make_requests([system + prompt(3, 60 + k) for k in range(3)],
                             SamplingParams(max_tokens=2, ignore_eos=True))
    llm.run(reqs, on_step=view)
    fig = prefix_cache_figure(view.snapshots, view.records)
    ax_t, ax_b = fig.axes[:2]
    hits = [p.get_height() for p in ax_t.containers[1]]
    assert sum(hits) == view.records[-1].prefix_hit_tokens == 2 * 24
    taken = [p.get_height() for p in ax_b.containers[1]]
    assert sum(taken) == 2 * 24 // 4             # the system prompt's 6 blocks, twice


def test_run_by_steps_adds_requests_at_their_step_and_changes_no_token(tiny):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = LLM(tiny, engine="paged", block_size=4)
    outputs = ref.run(ref.make_requests([prompt(7), prompt(9, 20)], params)).outputs
    expected = [o.token_ids for o in outputs]
    llm = LLM(tiny, engine="paged", block_size=4)
    reqs = llm.make_requests([prompt(7), prompt(9, 20)], params)
    records = run_by_steps(llm, [(0, reqs[0]), (3, reqs[1])])
    assert [r.added_step for r in reqs] == [0, 3]
    assert [r.output_token_ids for r in reqs] == expected
    assert [r.step for r in records] == list(range(1, len(records) + 1))
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prefill_decode_bars_are_the_step_records(tiny):
    llm = LLM(tiny, engine="paged", block_size=4, max_num_batched_tokens=12)
    shorts = llm.make_requests([prompt(3, 10 + k) for k in range(3)],
                               SamplingParams(max_tokens=10, ignore_eos=True))
    long = llm.make_requests([prompt(40)], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    view = LiveMemoryView()
    records = run_by_steps(llm, [(0, r) for r in shorts] + [(2, long)], on_step=view)
    fig = prefill_decode_figure(records, view.snapshots, budget=12)
    bars = {c.get_label(): [p.get_height() for p in c] for c in fig.axes[0].containers}
    assert bars["decode tokens (1 per running sequence)"] == [r.num_decode_tokens for r in records]
    assert bars["prefill tokens (prompt chunks)"] == [r.num_prefill_tokens for r in records]
    riding = [r for r in records if r.num_prefill_tokens and r.num_decode_tokens]
    assert len(riding) >= 3                       # the long prompt's chunks, decodes alongside
    assert sum(r.num_prefill_tokens for r in records) == 40 + 3 * 3


def test_priority_lets_a_late_urgent_request_ahead(tiny):
    first, views, late = {}, {}, {}
    for policy in ("fcfs", "priority"):
        llm = LLM(tiny, engine="paged", block_size=4, max_num_seqs=1, policy=policy)
        reqs = llm.make_requests([prompt(5, 10 + k) for k in range(4)],
                                 SamplingParams(max_tokens=3, ignore_eos=True))
        for r in reqs:
            r.priority = 1
        reqs[-1].priority = 0
        view = LiveMemoryView()
        run_by_steps(llm, [(0, r) for r in reqs[:-1]] + [(1, reqs[-1])], on_step=view)
        order = list(dict.fromkeys(rid for s in view.snapshots for rid in s.owners))
        first[policy], views[policy], late[policy] = order, view.snapshots, reqs[-1]
    assert first["fcfs"][-1] == late["fcfs"].request_id          # served last ...
    assert first["priority"][1] == late["priority"].request_id   # ... or right after the first
    fig = priority_figure(views, late)
    for ax, policy in zip(fig.axes, views):
        xs = [ln.get_xdata()[0] for ln in ax.lines]
        assert xs == [late[policy].added_step + 0.5]


def preemption_run(tiny, num_blocks: int, prompt_lens: list[int], output_lens: list[int]):
    llm = LLM(tiny, engine="paged", num_blocks=num_blocks, block_size=4)
    reqs = llm.make_requests([prompt(p, 10 + k) for k, p in enumerate(prompt_lens)],
                             [SamplingParams(max_tokens=k, ignore_eos=True) for k in output_lens])
    view = LiveMemoryView()
    result = llm.run(reqs, on_step=view)
    assert not any(o.error for o in result.outputs)
    counted = np.diff([0] + [r.num_preemptions for r in view.records])
    engine_steps = sorted(r.step for r, n in zip(view.records, counted) for _ in range(n))
    assert engine_steps, "the tiny pool should force preemption"
    return reqs, view, counted, engine_steps


@pytest.mark.parametrize("case, silent", [
    ((12, [9, 10, 11, 12], [14] * 4), 0),
    # one request is preempted at its very last step, then recomputed and finished within a
    # single step: it never holds KV again, so only the StepRecords' count can tell
    ((11, [3, 11, 7, 5, 6], [14, 9, 7, 11, 6]), 1),
])
def test_preemption_marks_sit_where_the_engine_preempted(tiny, case, silent):
    reqs, view, counted, engine_steps = preemption_run(tiny, *case)
    events = schedule_figures.preemption_events(view.snapshots, view.records)
    assert sorted(s for s, _ in events) == engine_steps
    marked = {rid: sum(1 for _, r in events if r == rid) for _, rid in events}
    assert marked == {r.request_id: r.num_preemptions for r in reqs if r.num_preemptions}
    ids, states = request_timeline(view.snapshots)
    steps = [s.step for s in view.snapshots]
    never_back = [rid for s, rid in events if not states[ids.index(rid), steps.index(s):].any()]
    assert len(never_back) == silent
    fig = schedule_figures.preemption_figure(view.snapshots, view.records)
    ax_n, ax = fig.axes[:2]
    marks = [c for c in ax.collections if c.get_gid() == "preempted"][0]
    assert sorted(int(x) for x, _ in marks.get_offsets()) == engine_steps
    assert [p.get_height() for p in ax_n.containers[0]] == list(counted)
