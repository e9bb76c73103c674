"""Stats flow one way (``runtime/stats.py``): the engine loop's thread builds an ``EngineStats``
after every step and ``/metrics`` (``serve/metrics.py``) and the dashboard read that record,
never the live engine, which only the loop's thread may touch (``serve/loop.py``).

Checked by behaviour, on a server-less ``EngineLoop`` and the tiny random model: with the loop's
thread held still mid-run (inside a step hook) and after the requests ran, every scraped gauge
and counter equals the engine's own count read on its thread, and the scrape reads nothing of the
engine (a stand-in for ``loop.engine`` notes every read made off the loop's thread); admission
control counts a request the engine took as waiting until a record says where it is. And
statically: ``metrics.py`` and ``dashboard.py`` contain no read of an engine's attribute (a
self-test plants one). Nothing here reads the clock: the loop is paused and resumed by events.
"""
from __future__ import annotations

import ast
import asyncio
import dataclasses
import threading
from pathlib import Path

import pytest

import minillm
from minillm import LLM, SamplingParams
from minillm.runtime.stats import EngineStats
from minillm.serve.dashboard import Dashboard
from minillm.serve.loop import EngineLoop, QueueFull
from minillm.serve.metrics import scrape

PKG = Path(minillm.__file__).parent
READERS = ("serve/metrics.py", "serve/dashboard.py")   # what runs for /metrics and the dashboard
ENGINE_NAMES = {"engine", "eng"}
# a pool too small for four requests at once (preemptions) and one shared prompt (prefix hits)
OPTIONS = dict(engine="paged", num_blocks=24, block_size=4, max_num_seqs=4,
               enable_prefix_caching=True)


def engine_counts(eng) -> dict[str, float]:
    """What /metrics should show, read from the engine itself (on the thread that drives it)."""
    kv = eng.kv_counts()
    return {"vllm:num_requests_running": eng.num_running(),
            "vllm:num_requests_waiting": eng.num_waiting(),
            "vllm:kv_cache_usage_perc": (kv.allocated / kv.total) if kv.total else 0.0,
            "minillm:kv_cache_bytes_per_token": kv.bytes_per_slot,
            "minillm:kv_cache_bytes": kv.total * kv.bytes_per_slot,
            "minillm:kv_cache_used_bytes": kv.allocated * kv.bytes_per_slot,
            "vllm:num_preemptions_total": eng.num_preemptions,
            "vllm:prefix_cache_hits_total": eng.prefix_hit_tokens,
            "minillm:engine_steps_total": eng.total_steps}


def scraped(loop: EngineLoop) -> dict[str, float]:
    gauges, counters = scrape(loop)
    assert not set(gauges) & set(counters)
    return {**gauges, **counters}


class Tripwire:
    """Stands in for ``loop.engine``: passes every read through to the engine and notes each one
    made on another thread than ``owner`` (the loop's, once known)."""

    def __init__(self, engine):
        self._engine, self.owner, self.reads_elsewhere = engine, None, []

    def __getattr__(self, name: str):
        if self.owner is not None and threading.current_thread() is not self.owner:
            self.reads_elsewhere.append(name)
        return getattr(self._engine, name)


async def final_event(events: asyncio.Queue):
    while (event := await events.get()).kind == "tokens":
        pass
    return event


def test_scraped_metrics_equal_the_engines_counts_read_on_its_thread(tiny):
    """Held mid-run, right after a step that preempted, with requests running and waiting: the
    scrape equals the engine's counts read on the loop's thread at that moment, and the dashboard
    frame built there too; again once every request ran. The scrape read no engine attribute."""
    llm = LLM(tiny, **OPTIONS)
    engine = llm.engine
    loop = EngineLoop(engine, max_waiting=16)
    board = Dashboard(loop, llm.tokenizer)
    reqs = llm.make_requests([f"the same shared prefix {i}" for i in range(4)],
                             SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    tripwire = Tripwire(engine)
    loop.engine = tripwire
    release, held = threading.Event(), {"done": False}

    async def main():
        aio = asyncio.get_running_loop()
        seen: asyncio.Future = aio.create_future()

        def hold(_loop: EngineLoop, out) -> None:       # the loop's thread, after the step
            if held["done"]:
                return
            tripwire.owner = threading.current_thread()
            busy = engine.num_running() > 0 and engine.num_waiting() > 0
            if busy and engine.num_preemptions > 0 and engine.prefix_hit_tokens > 0:
                held["done"] = True
                counts = {**engine_counts(engine), "arriving": len(loop.arriving())}
                board.build(0.0)                         # a frame, here on the loop's thread
                aio.call_soon_threadsafe(seen.set_result, (counts, board.frame))
                release.wait()                           # the engine stays as it is meanwhile
            elif not engine.has_unfinished():
                held["done"] = True
                aio.call_soon_threadsafe(seen.set_result, None)

        loop.on_step.append(hold)
        queues = [loop.submit(r) for r in reqs]
        loop.start()
        try:
            moment = await seen
            assert moment is not None, "no step had requests running and waiting after a " \
                                       "preemption: the workload no longer exercises the counts"
            counts, frame = moment
            tripwire.reads_elsewhere.clear()
            now = scraped(loop)
            assert tripwire.reads_elsewhere == []        # the scrape read only the record
            assert counts.pop("arriving") == 0
            assert {k: now[k] for k in counts} == counts
            assert counts["vllm:num_requests_running"] > 0 and counts["minillm:kv_cache_used_bytes"]
            assert frame["step"] == counts["minillm:engine_steps_total"]
            assert frame["stats"]["num_running"] == counts["vllm:num_requests_running"]
            assert frame["stats"]["num_waiting"] == counts["vllm:num_requests_waiting"]
            assert frame["stats"]["preemptions"] == counts["vllm:num_preemptions_total"]
            assert frame["kv"]["counts"]["allocated"] * frame["kv"]["bytes_per_slot"] == \
                counts["minillm:kv_cache_used_bytes"]
        finally:
            release.set()
        ends = [await final_event(q) for q in queues]
        assert [e.kind for e in ends] == ["done"] * len(reqs)

        # after the run: the engine's counts, read on its thread between two steps
        after: asyncio.Future = aio.create_future()
        loop.call_soon(lambda: aio.call_soon_threadsafe(after.set_result, engine_counts(engine)))
        counts = await after
        tripwire.reads_elsewhere.clear()
        now = scraped(loop)
        assert tripwire.reads_elsewhere == []
        assert {k: now[k] for k in counts} == counts
        assert counts["vllm:num_requests_running"] == counts["vllm:num_requests_waiting"] == 0
        assert counts["vllm:num_preemptions_total"] > 0 and counts["vllm:prefix_cache_hits_total"]
        text = loop.metrics.render(*scrape(loop))
        assert f'vllm:num_preemptions_total{{{loop.metrics.labels}}} ' \
               f'{counts["vllm:num_preemptions_total"]}\n' in text
        assert f'vllm:generation_tokens_total{{{loop.metrics.labels}}} {40 * len(reqs)}\n' in text

    try:
        asyncio.run(main())
    finally:
        release.set()
        loop.shutdown()


def test_a_request_the_engine_took_counts_as_waiting_until_a_record_says_where_it_is(tiny):
    """Admission control (429 when ``max_waiting`` wait) reads the record, not the engine: two
    requests the engine has taken, held before any step, still count, so with
    ``max_waiting=3`` a third is accepted and a fourth refused, as when it read the engine."""
    llm = LLM(tiny, engine="paged", num_blocks=64)
    loop = EngineLoop(llm.engine, max_waiting=3)
    a, b, c, d = llm.make_requests(["one", "two", "three", "four"], SamplingParams(max_tokens=2))
    release = threading.Event()

    async def main():
        aio = asyncio.get_running_loop()
        inside: asyncio.Future = aio.create_future()

        def hold() -> None:          # the loop's thread: a and b are in the engine, no step yet
            aio.call_soon_threadsafe(inside.set_result, llm.engine.num_waiting())
            release.wait()

        queues = [loop.submit(a), loop.submit(b)]
        loop.call_soon(hold)
        loop.start()
        try:
            assert await inside == 2
            assert loop.stats.num_waiting == 0 and loop.arriving() == []   # the record: before
            assert loop.num_waiting() == 2
            queues.append(loop.submit(c))
            with pytest.raises(QueueFull):
                loop.submit(d)
            assert loop.metrics.rejected == 1
        finally:
            release.set()
        assert [(await final_event(q)).kind for q in queues] == ["done"] * 3
        assert loop.num_waiting() == 0

    try:
        asyncio.run(main())
    finally:
        release.set()
        loop.shutdown()


def test_the_record_is_a_frozen_value_with_the_controllers_gauges(tiny):
    """``EngineStats.of(engine)`` is frozen; rung 12's cap and load come from ``batch_control()`` and
    reach /metrics unchanged (a loop not started: its record was built when it was made)."""
    llm = LLM(tiny, engine="paged", num_blocks=64, batch_controller="tpot", tpot_target_ms=50)
    stats = EngineStats.of(llm.engine)
    assert isinstance(stats, EngineStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_running = 1
    control = llm.engine.batch_control()
    assert stats.batch_cap == control["batch_cap"] is not None
    gauges, _ = scrape(EngineLoop(llm.engine))
    assert gauges["minillm:batch_cap"] == control["batch_cap"]
    assert ("minillm:batch_load" in gauges) == (control.get("load") is not None)
    (req,) = llm.make_requests(["waiting"], SamplingParams(max_tokens=3))
    llm.engine.add_request(req)
    try:
        detail = EngineStats.of(llm.engine, detail=True).detail
        assert [r.request_id for r in detail.waiting] == [req.request_id]
        assert detail.running == () and detail.snapshot.counts == llm.engine.kv_counts()
    finally:
        llm.engine.reset()


# --- static: what /metrics and the dashboard run reads no engine attribute ------------------------
def engine_reads(text: str, path: str = "<planted>") -> list[str]:
    """Each read of an engine in ``text``: an attribute of a name or attribute called ``engine``
    or ``eng`` (``loop.engine.num_preemptions``, ``eng.batch_control()``), the attribute
    ``engine`` itself (``e = loop.engine``, the first half of the same) and
    ``getattr(x, "engine")``."""
    bad = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute):
            base = node.value
            named = base.id if isinstance(base, ast.Name) else \
                base.attr if isinstance(base, ast.Attribute) else None
            if named in ENGINE_NAMES or node.attr in ENGINE_NAMES:
                bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_NAMES):
            bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    return bad


def test_metrics_and_dashboard_read_no_engine_attribute():
    for rel in READERS:
        assert engine_reads((PKG / rel).read_text(), rel) == []


def test_the_static_check_catches_planted_engine_reads():
    planted = ("def scrape(loop):\n"
               "    n = loop.engine.num_preemptions\n"
               "    eng = loop.engine\n"
               "    c = eng.batch_control()\n"
               "    e = getattr(loop, 'engine')\n"
               "    return self.loop.engine.num_waiting()\n")
    found = engine_reads(planted)
    assert "<planted>:2 loop.engine.num_preemptions" in found
    assert {f.split()[0] for f in found} == {f"<planted>:{n}" for n in range(2, 7)}
    clean = ("def scrape(loop):\n    s, waiting = loop.latest()\n"
             "    return s.num_preemptions, loop.stats.kv.total, view.engine_name, engines.x\n")
    assert engine_reads(clean) == []
