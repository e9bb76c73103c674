"""Observers (``runtime/observe.py``): every view watches the real engine through
``engine.observers``, never through state kept in core objects.

Checked here: the phases of each step arrive in order with the run's step numbers; rung 6's
``SpecTrace`` sees verifications that are exactly what landed in the output, and the pool at its
fullest; beam choices reach a trace only through an observer; an observer that raises ends the
run cleanly (pool full, engine usable); and no view writes into an engine's objects (a scan of
the package and the notebooks)."""
from __future__ import annotations

import ast
import gc
import json
import weakref
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import random_prompts
from minillm import LLM, SamplingParams
from minillm.runtime.observe import PHASES, StepEvent
from minillm.engines.r6_speculative import SpecTrace
from minillm.lab.checks import check_block_invariants
from minillm.viz.traces import replay_trace, record_paged_run, trace_from_run

ROOT = Path(__file__).resolve().parents[2]


def mixed_requests(llm, seed=3):
    """A plain request, an n = 2 request and a beam search, in one batch."""
    prompts = random_prompts(3, seed=seed, lo=3, hi=12)
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=5, beam_width=2, ignore_eos=True)]
    return llm.make_requests(prompts, params)


def assert_pool_full(engine):
    bm = engine.block_manager
    check_block_invariants(bm, engine.scheduler.live_seqs())
    assert bm.num_free_blocks == bm.num_blocks, "every block back in the pool"
    assert not engine.has_unfinished()


@pytest.mark.parametrize("options", [{}, {"num_blocks": 9, "block_size": 4}])
def test_phases_arrive_in_order_with_the_runs_step_numbers(tiny, options):
    llm = LLM(tiny, engine="paged", **options)
    events: list[StepEvent] = []
    with llm.engine.observers.watching(events.append):
        result = llm.run(mixed_requests(llm))
    assert len(llm.engine.observers) == 0, "watching removes its observer"
    by_step = defaultdict(list)
    for e in events:
        assert e.phase in PHASES and e.engine is llm.engine
        by_step[e.step].append(e)
    assert sorted(by_step) == [r.step for r in result.steps] == list(range(1, len(result.steps) + 1))
    order = {p: i for i, p in enumerate(("executed", "computed", "beam", "stepped"))}
    beam_id = result.outputs[2].request_id
    for step, evs in by_step.items():
        phases = [e.phase for e in evs]
        assert phases == sorted(phases, key=order.__getitem__), f"step {step}: {phases}"
        assert phases.count("stepped") == 1 and phases.count("computed") <= 1
        assert phases.count("executed") == 1, f"step {step}: one forward, one span"
        start, end = next(e.data for e in evs if e.phase == "executed")
        assert 0 < start <= end
        assert all(e.request_id == beam_id for e in evs if e.phase == "beam")
    finished = [r.request_id for e in events if e.phase == "stepped" for r in e.data.finished]
    assert sorted(finished) == sorted(o.request_id for o in result.outputs), "each ends once"
    # the beam search chose once per generated token: 5 choices, whatever the preemptions
    assert sum(e.phase == "beam" for e in events) == 5
    if options:
        assert result.metrics.num_preemptions > 0, "the tight pool preempts"
    assert_pool_full(llm.engine)


@pytest.mark.parametrize("engine", ["naive", "dynamic", "paged", "paged+ngram", "paged-async",
                                    "paged+lora"])
def test_an_engine_is_freed_when_its_last_reference_goes(tiny, engine):
    """No reference cycle keeps an engine (and its KV pool, a GiB by default) alive after its user
    lets go, with observers attached and a run done: the observers reach back to it weakly, and
    so does the block manager's prefix seed. Checked with the garbage collector off, which a
    cycle would need (with one, each test worker holds 5-6 GB and notebook 09's kernel reaches
    9 GB)."""
    llm = LLM(tiny, engine=engine)
    seen = []
    llm.engine.observers.add(lambda e: seen.append(e.phase))   # (an event holds its engine)
    llm.run(mixed_requests(llm) if llm.engine.supports_parallel else
            llm.make_requests(random_prompts(2, seed=1, lo=3, hi=9), SamplingParams(max_tokens=3)))
    gone = weakref.ref(llm.engine)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    finally:
        gc.enable()
    assert seen, "the observer saw the run"


def test_spec_trace_sees_what_landed_and_the_pool_at_its_fullest(tiny):
    llm = LLM(tiny, engine="paged", speculative="draft", draft_layers=1,
              num_speculative_tokens=3, block_size=2)
    spec = llm.engine.observers.add(SpecTrace())
    reqs = llm.make_requests(random_prompts(3, seed=8, lo=3, hi=10),
                             SamplingParams(max_tokens=12, ignore_eos=True))
    result = llm.run(reqs)
    tokens = {r.request_id: list(r.prompt_token_ids) + o.token_ids
              for r, o in zip(reqs, result.outputs)}
    assert spec.verifications, "the draft model guesses at every decode"
    for v in spec.verifications:
        a, kept, guesses = v["num_accepted"], list(v["kept"]), list(v["guesses"])
        assert kept[:a] == guesses[:a] and len(kept) in (a, a + 1) and a <= len(guesses)
        ctx = v["context"]
        assert tokens[v["request_id"]][ctx:ctx + len(kept)] == kept, "kept tokens are the output"
    assert 0 < sum(v["num_accepted"] for v in spec.verifications) < sum(
        len(v["guesses"]) for v in spec.verifications), "some guesses kept, some rejected"
    assert set(spec.snapshots) == {v["step"] for v in spec.verifications}
    after = {r.step: r.kv.allocated for r in result.steps}
    for step, snap in spec.snapshots.items():
        assert snap.step == step
        assert snap.counts.allocated >= after[step], "the rejected guesses' slots are given back"
    assert any(snap.counts.allocated > after[s] for s, snap in spec.snapshots.items())
    assert result.metrics.extra["speculative"]["num_accepted"] == sum(
        v["num_accepted"] for v in spec.verifications)
    assert_pool_full(llm.engine)


def test_a_beam_search_is_traced_through_an_observer_only(tiny):
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=9)
    reqs = mixed_requests(llm, seed=4)
    result, trace = record_paged_run(llm, reqs)
    assert len(llm.engine.observers) == 0
    beam = next(r for r in trace.requests if r.beam_width > 1)
    assert len(beam.beam_choices) == 5
    replay = replay_trace(trace)
    assert [s.kv for s in replay.steps] == [s.kv for s in result.steps]
    with pytest.raises(ValueError, match=f"{beam.request_id} is a beam search"):
        trace_from_run(result, reqs, llm.engine)
    assert not hasattr(reqs[2], "beam_choices"), "no view's state on the request"


@pytest.mark.parametrize("phase", ["computed", "beam", "stepped"])
def test_an_observer_that_raises_ends_the_run_cleanly(tiny, phase):
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=9)
    fresh = LLM(tiny, engine="paged", block_size=4, num_blocks=9).run(mixed_requests(llm))

    def bad(event):
        if event.phase == phase and event.step == 3:
            raise RuntimeError(f"observer failed at {phase}")

    llm.engine.observers.add(bad)
    with pytest.raises(RuntimeError, match=f"observer failed at {phase}"):
        llm.run(mixed_requests(llm))
    assert_pool_full(llm.engine)
    llm.engine.observers.remove(bad)
    again = llm.run(mixed_requests(llm))
    assert [o.samples or [o.token_ids] for o in again.outputs] == [
        o.samples or [o.token_ids] for o in fresh.outputs]
    assert_pool_full(llm.engine)


def test_observers_must_be_callable(tiny):
    engine = LLM(tiny, engine="paged").engine
    with pytest.raises(TypeError, match="observer must be callable"):
        engine.observers.add("not a function")


# --- no view writes into the engine ------------------------------------------------------------
ENGINE_PARTS = {"engine", "scheduler", "block_manager", "bm", "runner", "sampler"}
ALLOWED = {
    # rung 7's own measurement tool, not a view: micro-batches are rank 0's alone (engine.py)
    ("minillm/bench/pipeline.py", "engine.num_microbatches"),
}


def _attribute_writes(src: str):
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names, n = [], t
                while isinstance(n, ast.Attribute):
                    names.append(n.attr)
                    n = n.value
                if isinstance(n, ast.Name):
                    names.append(n.id)
                names.reverse()
                if isinstance(t, ast.Attribute) and ENGINE_PARTS & set(names[:-1]):
                    yield ".".join(names)


def _code_cells(path: Path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            yield "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))


def view_writes():
    found = set()
    for path in sorted((ROOT / "minillm").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("minillm/core/", "minillm/engines/r")) and "measure" not in rel:
            continue                       # an engine may set its own parts up
        found |= {(rel, w) for w in _attribute_writes(path.read_text())}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for src in _code_cells(path):
            found |= {(path.relative_to(ROOT).as_posix(), w) for w in _attribute_writes(src)}
    return found


def test_no_view_writes_into_an_engine():
    assert view_writes() <= ALLOWED, sorted(view_writes() - ALLOWED)


def test_the_scan_sees_a_write():
    assert list(_attribute_writes("engine.scheduler.select_beams = f")) == [
        "engine.scheduler.select_beams"]
    assert list(_attribute_writes("llm.engine.trace = []")) == ["llm.engine.trace"]
    assert list(_attribute_writes("view.title = 'x'")) == []


def test_an_observer_of_some_phases_sees_only_those(tiny):
    llm = LLM(tiny, engine="paged", num_blocks=9, block_size=4)
    obs = llm.engine.observers
    everything, computed = [], []
    with obs.watching(everything.append), obs.watching(computed.append, ("computed",)):
        assert obs.wants("computed") and obs.wants("stepped") and len(obs) == 2
        llm.run(mixed_requests(llm))
    assert computed and {e.phase for e in computed} == {"computed"}
    assert [e for e in everything if e.phase == "computed"] == computed
    assert len(obs) == 0 and not obs.wants("computed")
    with pytest.raises(ValueError, match="unknown observer phases \\['compute'\\]"):
        obs.add(computed.append, ("compute",))
