"""Exercise 12-async — the executor that overlaps a step's forward with the caller's work
(``async_scheduling=True``): ``ThreadExecutor.submit``, ``.wait`` and ``.call``
(``minillm/engines/r12_realtime/engine.py``). The step loop that uses it is the core's
(``PagedEngine._step``: land the step in flight, then launch the next one ahead).

Graded on behaviour, never on the clock: every step is billed by a cost model (``step_cost``), so
the scheduler's clock and the ``slo`` policy's deadlines are the same on every machine. Your
engine serves a workload (greedy, seeded and n = 3 sampling, beams, a shared prefix) in a pool
tight enough to preempt, and with chunked prefills and prefix hits, while the scheduler of that
engine is watched: each time it plans a step, every step launched before must have landed (its
tokens sampled, its K/V committed), and each time tokens land, they must land in a request that is
still running (not one preempted or ended while its step was in flight), each step once. Then the
tokens, the finish reasons, the preemptions, the prefix hits, the clock and the billed tokens must
be the synchronous ``PagedEngine``'s (run here, by the package's own code), the pool full at the
end. Last, an abort while a forward is in flight: the request ends once, at the next step, keeping
its tokens (that step's too), reported by that step's output (not a later one's: every
request's finish is counted per step, and must fall on the synchronous engine's steps), and
nothing of it lands after it ended. And the forward and the
sampler both run on the executor's one worker thread, with the caller's torch thread count.

The runs happen in the student's process (``probe_*``, the ``student`` fixture) and send back
what happened, judged here.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from minillm import Request
from minillm.lab.reference import baseline, mixed_requests, tiny_model

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
MAX_STEPS = 2000     # a run that has not drained by then never will (a hang is a failure)
EXECUTOR = "ThreadExecutor"


def cost(sched) -> float:
    """Each step's bill (ms): a cost model, so that the clock never depends on the machine."""
    return 2.0 + 0.25 * sched.num_tokens


def workload() -> list[Request]:
    return mixed_requests()


def watch(engine) -> dict:
    """Watch the engine's scheduler (instance attributes, this engine only): ``early`` — steps
    planned while a step launched before had not landed; ``leaks`` — tokens landing in a request
    not running; ``twice`` — a step landing more often than steps were launched."""
    sched = engine.scheduler
    log = {"launched": 0, "landed": 0, "early": [], "leaks": [], "twice": 0}
    plan, land = sched.schedule, sched.update_from_output

    def schedule(*args, **kwargs):
        if log["landed"] < log["launched"]:
            log["early"].append(log["launched"])
        out = plan(*args, **kwargs)
        log["launched"] += bool(out.scheduled)
        return out

    def update_from_output(sampled):
        log["landed"] += 1
        log["twice"] += log["landed"] > log["launched"]
        for seq, *_ in list(sampled.tokens) + list(sampled.beam_logprobs):
            group = sched.groups.get(seq.request.request_id)
            state = ("ended" if group is None else "preempted" if group not in sched.running
                     else "running" if seq in group.seqs else "a finished sample")
            if state != "running":
                log["leaks"].append([seq.request.request_id, state])
        return land(sampled)

    sched.schedule, sched.update_from_output = schedule, update_from_output
    return log


def abort_in_flight(engine, rid: str) -> dict:
    """Abort ``rid`` while a forward is in flight — once that forward has computed, so that a
    mistake shows the same on every run (the race of freeing blocks under a running forward
    would not) — and say what the abort did at once."""
    flight = engine.in_flight[0] if engine.in_flight else None
    if flight is not None:
        flight.handle.result()              # (its result stays for the next step to land)
    group = engine.groups.get(rid)
    had = [len(s.output_token_ids) for s in group.seqs] if group else None
    answers = [engine.abort(rid), engine.abort(rid), engine.abort("nope")]
    group = engine.groups.get(rid)
    return {"in_flight": flight is not None, "had": had, "answers": answers,
            "ended_at_once": group is None or group.request.finished
            or not any(s.block_table for s in group.seqs)}


def probe_serve(kind: str, opts: dict, abort: tuple | None = None) -> dict:
    """``workload()`` through the ``kind`` engine ("async": yours; "sync": ``PagedEngine``), every
    step billed by ``cost``. ``abort = (request id, after how many steps)``: abort it then."""
    from minillm.core.engine import PagedEngine
    from minillm.engines.r12_realtime.engine import ThreadExecutor
    from minillm.engines import engine_kwargs
    executor = ThreadExecutor() if kind == "async" else None
    engine = PagedEngine(tiny_model(), step_cost=cost, executor=executor, **engine_kwargs(opts))
    log, reqs = watch(engine), []
    for r in workload():
        try:
            engine.validate(r)        # (r4 and r8 never fit the 18-block pool: left out)
        except ValueError:
            continue
        engine.add_request(r)
        reqs.append(r)
    finals, raised, asked, billed = Counter(), None, {}, [0, 0.0]
    at_step: dict[str, list[int]] = {}       # request -> the steps whose output reported it
    try:
        for i in range(MAX_STEPS):
            if not engine.has_unfinished():
                break
            out = engine.step()
            billed[0] += out.num_prefill_tokens + out.num_decode_tokens
            billed[1] += out.prefill_ms + out.decode_ms
            for req in out.finished:
                finals[req.request_id] += 1
                at_step.setdefault(req.request_id, []).append(i)
            if abort is not None and i + 1 == abort[1]:
                asked = abort_in_flight(engine, abort[0])
    except NotImplementedError:
        raise
    except Exception as e:      # noqa: BLE001 - judged by the grader, with what the watch saw
        raised = f"{type(e).__name__}: {e}"
    bm = engine.block_manager
    result = {"log": log, "raised": raised, "finals": dict(finals), "asked": asked,
              "at_step": at_step,
              "unfinished": bool(engine.has_unfinished()) if raised is None else None,
              "tokens": {r.request_id: [[int(t) for t in s] for s in r.samples] for r in reqs},
              "reasons": {r.request_id: [str(getattr(o.finish_reason, "value", o.finish_reason))
                                         for o in r.outputs] for r in reqs},
              "preemptions": int(engine.num_preemptions), "hits": int(engine.prefix_hit_tokens),
              "clock": float(engine.scheduler.now_ms), "billed": billed,
              "free": int(bm.num_free_blocks), "blocks": int(bm.num_blocks),
              "overlap": int(executor.overlap.steps) if kind == "async" else None}
    if kind == "async" and raised is None:
        result["in_flight"] = bool(engine.in_flight)
    engine.close()
    return result


def judge_watch(got: dict) -> None:
    """What the watch saw, in the order the mistakes cause each other."""
    log = got["log"]
    assert not log["early"], (
        f"step {log['early'][0] + 1} was planned (Scheduler.schedule) while step "
        f"{log['early'][0]} had not landed: its tokens were not sampled yet nor its K/V "
        f"committed, so the plan used tokens that did not exist. {EXECUTOR}.wait must return "
        "the forward's own result, once it is done")
    assert not log["twice"], (
        f"{log['landed']} steps landed, {log['launched']} were launched: a step landed twice "
        f"({EXECUTOR}.wait returns each forward's result once)")
    for rid, state in log["leaks"][:1]:
        assert state != "preempted", (
            f"request {rid} was preempted while its step was in flight, and that step's token "
            "landed in it afterwards: a token for a request that has given its blocks back and "
            "will recompute (a placeholder leaking into its output)")
        assert state != "ended", (
            f"request {rid} ended (aborted) while its step was in flight, and that step's tokens "
            "then landed in a request that no longer exists (its blocks back in the pool while "
            "the forward wrote them)")
        raise AssertionError(f"tokens landed in request {rid}'s {state}: {log['leaks'][:4]}")
    assert got["raised"] is None, f"your engine raised {got['raised']}"
    assert not got["unfinished"], (
        f"requests still unfinished after {MAX_STEPS} steps: does every step land? are the "
        "deferred aborts applied?")


OPTIONS = {
    "preempting": dict(num_blocks=18, block_size=4, max_num_seqs=6, attention_backend="torch"),
    "chunked-prefix-slo": dict(num_blocks=64, block_size=4, max_num_seqs=4,
                               max_num_batched_tokens=24, enable_prefix_caching=True,
                               policy="slo", attention_backend="torch"),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_overlapped_engine_is_the_synchronous_engine(student, name):
    opts = OPTIONS[name]
    got = student.run(probe_serve, "async", opts)
    judge_watch(got)
    want = baseline(student, probe_serve, "sync", opts)
    assert all(got["finals"].get(rid) == 1 for rid in want["tokens"]), (
        f"every request is reported finished exactly once (StepOutput.finished): {got['finals']}")
    late = {rid: (got["at_step"].get(rid), steps) for rid, steps in want["at_step"].items()
            if got["at_step"].get(rid) != steps}
    assert not late, (
        f"{name}: requests reported finished (StepOutput.finished) at other steps than the "
        f"synchronous engine's (request: (yours, its)): {late}: step N's output reports what "
        "finished in step N, the step that landed in that call")
    for rid, tokens in want["tokens"].items():
        assert got["tokens"][rid] == tokens, (
            f"{name}: request {rid}'s samples differ from the synchronous engine's\n"
            f"got  {got['tokens'][rid]}\nwant {tokens}")
    assert got["reasons"] == want["reasons"], f"{name}: finish reasons differ: {got['reasons']}"
    assert (got["preemptions"], got["hits"]) == (want["preemptions"], want["hits"]), (
        f"{name}: preemptions, prefix-hit tokens {got['preemptions'], got['hits']}; the "
        f"synchronous engine's {want['preemptions'], want['hits']}")
    if name == "preempting":
        assert want["preemptions"] > 0, "the pool was meant to be tight enough to preempt"
    assert got["clock"] == pytest.approx(want["clock"]), (
        f"{name}: the scheduler's clock ended at {got['clock']:.2f} ms, the synchronous "
        f"engine's at {want['clock']:.2f}: bill every step once, as it lands "
        f"({EXECUTOR}.wait returns (result, forward ms) as the forward returned them)")
    assert got["billed"][0] == want["billed"][0] and \
        got["billed"][1] == pytest.approx(want["billed"][1]), (
        f"{name}: the step outputs account for {got['billed'][0]} tokens in "
        f"{got['billed'][1]:.2f} ms, the synchronous engine's {want['billed'][0]} in "
        f"{want['billed'][1]:.2f}")
    assert got["free"] == got["blocks"], f"{name}: {got['blocks'] - got['free']} blocks leaked"
    assert not got.get("in_flight"), "a forward is still in flight after the last step"
    assert got["overlap"] == got["log"]["launched"], (
        f"self.overlap counted {got['overlap']} steps of {got['log']['launched']} landed: "
        f"{EXECUTOR}.wait adds each forward it waited for (steps, forward_ms, waited_ms)")


ABORTS = dict(num_blocks=32, block_size=4, max_num_seqs=6, attention_backend="torch")


def test_an_abort_while_a_forward_is_in_flight_ends_the_request_once(student):
    """r1 (13 tokens to sample) is aborted after 4 steps, its decode in flight: the abort says
    yes once (no for a repeat, no for an unknown id); r1 ends at the next step, with the tokens
    it had and that step's, a prefix of what it would have sampled; nobody else is aborted."""
    got = student.run(probe_serve, "async", ABORTS, ("r1", 4))
    asked = got["asked"]
    assert not (asked and asked["in_flight"] and asked["ended_at_once"]), (
        "abort('r1') ended r1 at once (its blocks freed) while its step was in flight: the "
        "forward writes those blocks and its token is still to land. While a forward is in "
        "flight, abort only notes the id; the request ends once that step has landed")
    judge_watch(got)
    assert asked and asked["in_flight"] and asked["had"], \
        "after 4 steps a forward of r1 should be in flight (does submit return at once?)"
    assert asked["answers"] == [True, False, False], (
        f"abort('r1'), again, and abort('nope') answered {asked['answers']}: True when it "
        "cancels the request, False when asked again while it is pending, or for an unknown "
        "(or finished) request")
    assert got["finals"] == {rid: 1 for rid in got["tokens"]}, (
        f"every request is reported finished exactly once (the aborted one in the step that "
        f"applies the abort): {got['finals']}")
    assert got["at_step"]["r1"] == [4], (
        f"r1 was aborted after step 4 while step 5 was in flight: step 5 lands it and ends it, "
        f"and step 5's output reports it (StepOutput.finished), not a later one; it was "
        f"reported by step {[i + 1 for i in got['at_step']['r1']]}")
    assert got["reasons"]["r1"] == ["abort"], f"r1 ends aborted, got {got['reasons']['r1']}"
    assert all(r != ["abort"] for rid, r in got["reasons"].items() if rid != "r1"), \
        f"only r1 was aborted: {got['reasons']}"
    whole = baseline(student, probe_serve, "sync", ABORTS)["tokens"]["r1"][0]
    mine, had = got["tokens"]["r1"][0], asked["had"][0]
    assert had <= len(mine) <= had + 1 and mine == whole[:len(mine)], (
        f"r1 had {had} tokens when aborted; it keeps them and the token of the step in flight: "
        f"got {mine}, its tokens unaborted {whole}")
    assert got["free"] == got["blocks"], f"{got['blocks'] - got['free']} blocks leaked"


def probe_threads() -> dict:
    """Where the forward and the sampler ran, and with how many torch threads, in your engine."""
    import threading
    from minillm.core.engine import PagedEngine
    from minillm.engines.r12_realtime.engine import ThreadExecutor
    torch.set_num_threads(3)      # no thread's default (OMP_NUM_THREADS, or the cores)
    engine = PagedEngine(tiny_model(), executor=ThreadExecutor(), step_cost=cost, num_blocks=32,
                         block_size=4, attention_backend="torch")
    seen = []
    phases = {"executed": "forward", "computed": "sampler"}   # (the sampler runs after "computed")

    def where(event):
        if event.phase in phases:
            seen.append((phases[event.phase], threading.current_thread().name,
                         torch.get_num_threads()))

    engine.observers.add(where)
    for r in workload()[:3]:
        engine.add_request(r)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        engine.step()
    engine.close()
    return {"caller": threading.current_thread().name, "seen": seen}


def test_the_forward_and_the_sampler_run_on_the_worker_thread(student):
    """Both on the executor's one worker thread (one OpenMP team: docs/rungs/12_realtime.md),
    with the caller's thread count; never on the caller's thread (nothing would overlap)."""
    got = student.run(probe_threads)
    seen, caller = got["seen"], got["caller"]
    assert {w for w, _, _ in seen} == {"forward", "sampler"}, f"ran: {sorted(set(seen))[:4]}"
    here = sorted({w for w, t, _ in seen if t == caller})
    assert not here, (
        f"the {' and the '.join(here)} ran on the caller's thread: submit puts the forward on "
        "the worker thread and returns at once; call runs the commit (the sampler) there too, "
        "while the caller waits")
    threads = {t for _, t, _ in seen}
    assert len(threads) == 1, f"forwards and samplers ran on {len(threads)} threads: {threads}"
    counts = {n for _, _, n in seen}
    assert counts == {3}, (f"torch ran with {counts} threads on the worker: submit sets the "
                           "caller's count there (torch.get_num_threads())")
