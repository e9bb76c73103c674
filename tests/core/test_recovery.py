"""The engine survives what users throw at it: preempted beams and samples, failed and interrupted
calls, two threads at once, a batch at the edge of the context. After each, every request has
ended exactly once and the KV pool is back to full."""
from __future__ import annotations

import threading
from collections import Counter

import pytest

from conftest import drain, engine_params, random_prompts
from minillm import LLM, FinishReason, Request, SamplingParams
from minillm.engines import ENGINES, create_engine


def assert_pool_full(engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a KV block leaked"
    assert not engine.groups and not engine.scheduler.has_unfinished()


def tight_paged(tiny, **kw):
    return create_engine("paged", tiny, block_size=4, num_blocks=22, max_num_batched_tokens=8, **kw)


@pytest.mark.parametrize("params", [
    SamplingParams(beam_width=3, max_tokens=10),
    SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(n=3, max_tokens=10, ignore_eos=True),
], ids=["beams", "n4-seeded", "n3-greedy"])
@pytest.mark.parametrize("prefix", [False, True])
def test_preempted_groups_finish_and_match_a_roomy_run(tiny, params, prefix):
    """A preempted beam group must not spin forever, nor a preempted n > 1 group crash: recompute
    computes the prompt once and re-shares it, so a group needs what it was admitted with."""
    prompts = random_prompts(3, seed=40, lo=20, hi=20)
    engine = tight_paged(tiny, enable_prefix_caching=prefix)
    reqs = [Request(p, params) for p in prompts]
    for r in reqs:
        engine.validate(r)
        engine.add_request(r)
    finals = drain(engine)
    assert engine.scheduler.num_preemptions > 0, "the test must preempt"
    assert all(finals[r.request_id] == 1 for r in reqs)
    assert_pool_full(engine)
    roomy = LLM(tiny, engine="paged").generate(prompts, params)
    assert [r.samples for r in reqs] == [o.samples for o in roomy]
    assert all(len(r.samples) == max(params.n, params.beam_width) for r in reqs)


def test_beam_search_cli_does_not_hang(tmp_path):
    import json
    import subprocess
    import sys
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p, "beam_width": 3, "max_tokens": 10})
                           + "\n" for p in random_prompts(3, seed=40, lo=20, hi=20)))
    r = subprocess.run([sys.executable, "-m", "minillm", "generate", "--model", "tiny-llama",
                        "--prompts", str(src), "--out", str(dst), "--block-size", "4",
                        "--num-blocks", "22", "--max-num-batched-tokens", "8", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(rows) == 3 and all(len(row["samples"]) == 3 for row in rows)


@pytest.mark.parametrize("params", [SamplingParams(n=3, max_tokens=20, temperature=1, seed=1,
                                                   ignore_eos=True),
                                    SamplingParams(beam_width=2, max_tokens=20, ignore_eos=True)],
                         ids=["n3", "beams"])
def test_aborted_group_keeps_partial_samples(tiny, params):
    engine = create_engine("paged", tiny)
    req = Request(random_prompts(1, seed=41)[0], params)
    engine.add_request(req)
    for _ in range(5):
        engine.step()
    assert engine.abort(req.request_id)
    finals = drain(engine)
    assert finals[req.request_id] == 1 and req.finish_reason == FinishReason.ABORT
    assert len(req.samples) == max(params.n, params.beam_width)
    assert all(0 < len(s) < 20 for s in req.samples), req.samples
    assert req.output_token_ids == req.samples[0]
    assert_pool_full(engine)


def test_step_driven_engine_forgets_finished_requests(tiny):
    """A server drives ``step()`` forever: finished requests must not pile up inside."""
    engine = create_engine("paged", tiny)
    for i, p in enumerate(random_prompts(30, seed=42)):
        engine.add_request(Request(p, SamplingParams(max_tokens=3, n=1 + i % 3, temperature=1,
                                                     seed=i)))
    drain(engine)
    assert_pool_full(engine)


# --- one bad call never poisons the next ------------------------------------------------------------
class Boom(Exception):
    pass


def fail_after(n: int, exc: BaseException):
    calls = Counter()

    def on_step(snapshot, record):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
    return on_step


@pytest.mark.parametrize("engine_name", engine_params(ENGINES))
@pytest.mark.parametrize("exc", [Boom("callback failed"), KeyboardInterrupt()], ids=["boom", "ctrl-c"])
def test_failed_run_leaves_engine_clean(tiny, engine_name, exc):
    prompts = random_prompts(4, seed=43)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(tiny, engine=engine_name)
    reqs = llm.make_requests(prompts, params)
    with pytest.raises(type(exc)):
        llm.run(reqs, on_step=fail_after(2, exc))
    assert not llm.engine.has_unfinished()
    assert all(r.finish_reason in (FinishReason.ABORT, FinishReason.LENGTH) for r in reqs)
    assert any(r.finish_reason == FinishReason.ABORT for r in reqs)
    again = llm.generate(prompts, params)
    fresh = LLM(tiny, engine=engine_name).generate(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh]
    assert len({o.request_id for o in again} | {r.request_id for r in reqs}) == 8, \
        "request ids must be unique for the life of an LLM"
    if engine_name == "paged":
        assert_pool_full(llm.engine)


def test_exception_in_on_output_and_bad_params_leave_engine_clean(tiny):
    llm = LLM(tiny, engine="paged", num_blocks=16, block_size=4)
    prompts = random_prompts(5, seed=44)

    def on_output(out):
        raise Boom("consumer failed")
    with pytest.raises(Boom):
        llm.generate(prompts, SamplingParams(max_tokens=5, n=2, temperature=1, seed=0),
                     on_output=on_output)
    assert_pool_full(llm.engine)
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate(prompts[:2], [SamplingParams()] * 3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert all(len(o.token_ids) == 5 for o in outs)
    assert_pool_full(llm.engine)


def test_run_rejects_duplicate_and_reused_requests(tiny):
    engine = create_engine("paged", tiny)
    a, b = (Request([5, 6, 7], SamplingParams(max_tokens=2), request_id="same") for _ in range(2))
    with pytest.raises(ValueError, match="duplicate request id 'same'"):
        engine.run([a, b])
    done = Request([5, 6, 7], SamplingParams(max_tokens=2))
    engine.run([done])
    with pytest.raises(ValueError, match="has already been run"):
        engine.run([done])
    with pytest.raises(ValueError, match="takes Request objects, got str"):
        engine.run(["hello"])
    assert_pool_full(engine)


def test_two_threads_share_one_llm(tiny):
    """``generate`` calls from two threads are served one after the other (a lock)."""
    llm = LLM(tiny, engine="paged")
    prompts = [random_prompts(6, seed=45 + k) for k in range(2)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [llm.generate(p, params) for p in prompts]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2, timeout=60)

    def worker(k: int) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                results.setdefault(k, []).append(llm.generate(prompts[k], params))
        except BaseException as e:   # reported by the main thread
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    for k in range(2):
        for outs in results[k]:
            assert [o.token_ids for o in outs] == [o.token_ids for o in expected[k]]
    assert_pool_full(llm.engine)


def test_generate_from_its_own_callback_is_refused(tiny):
    llm = LLM(tiny, engine="paged")

    def on_step(snapshot, record):
        llm.generate(["again"])
    with pytest.raises(RuntimeError, match="cannot be called from inside their own callbacks"):
        llm.generate(["hi"], SamplingParams(max_tokens=3), on_step=on_step)
    assert llm.generate(["hi"], SamplingParams(max_tokens=3))[0].finish_reason is not None
    assert_pool_full(llm.engine)


# --- the static engine at the edge of the context ------------------------------------------------------
def test_static_batch_near_context_limit(tiny):
    """Rows of different lengths near the context: each stops at its own limit, and the rectangle
    (wider than the context behind left padding) never overflows."""
    n = tiny.max_model_len
    prompts = [[5] * (n - 10), [6] * (n - 40), [7] * 5]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    outs = LLM(tiny, engine="static").generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [10, 40, 64]
    assert all(o.finish_reason == FinishReason.LENGTH for o in outs)
    alone = LLM(tiny, engine="dynamic", max_num_seqs=1).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
