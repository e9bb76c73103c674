"""Exercise 02 — dynamic batching: ``DynamicBatchEngine._admit`` (join) and ``_compact`` (leave).

More requests than rows: newcomers join as soon as rows free up, finished requests leave at once.
The engine must keep its list of rows and its KV rectangle in step after every step, never run
more than ``max_num_seqs`` requests, end empty, and produce Hugging Face's tokens for each request.
"""
from __future__ import annotations

from minillm import SamplingParams
from minillm.engines.r2_dynamic import DynamicBatchEngine
from minillm.lab.reference import assert_greedy_match, hf_greedy, random_prompts
from minillm.request import Request


def run_checked(tiny, prompts, lengths, max_num_seqs, arrivals=None):
    engine = DynamicBatchEngine(tiny, max_num_seqs=max_num_seqs)
    reqs = [Request(p, SamplingParams(max_tokens=n, ignore_eos=True), request_id=f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    for r, t in zip(reqs, arrivals or [0.0] * len(reqs)):
        r.arrival_offset_s = t
    peak = 0

    def after_step(snapshot, record):
        nonlocal peak
        live = [r for r in engine.rows if r is not None]
        assert engine.kv is None or engine.kv.rows == len(engine.rows), (
            f"after step {record.step}: {len(engine.rows)} rows listed but the KV rectangle has "
            f"{engine.kv.rows} — compaction must drop the same rows from both")
        assert all(not r.finished for r in live), \
            f"after step {record.step}: a finished request still holds a row"
        peak = max(peak, len(live))
        assert len(live) <= max_num_seqs, f"{len(live)} requests running, max_num_seqs is {max_num_seqs}"

    result = engine.run(reqs, on_step=after_step)
    assert not engine.has_unfinished() and not [r for r in engine.rows if r is not None], \
        "the engine must end with no request in its rows"
    return result, peak


def test_join_and_leave_equal_hf_generate(tiny):
    prompts = random_prompts(7, seed=21, lo=2, hi=30)
    lengths = [3, 12, 5, 9, 2, 7, 4]
    result, peak = run_checked(tiny, prompts, lengths, max_num_seqs=3)
    assert peak == 3, "with 7 requests and 3 rows, newcomers must fill every free row"
    for i, (p, n, o) in enumerate(zip(prompts, lengths, result.outputs)):
        assert o.error is None, o.error
        assert_greedy_match(o.token_ids, hf_greedy(tiny, p, n), label=f"request r{i}")


def test_a_request_that_ends_at_once_never_takes_a_row(tiny):
    """max_tokens=1: done after its prefill token, it must finish without joining the batch."""
    prompts = random_prompts(4, seed=22, lo=2, hi=20)
    result, _ = run_checked(tiny, prompts, [1, 6, 1, 4], max_num_seqs=2)
    for p, n, o in zip(prompts, [1, 6, 1, 4], result.outputs):
        assert_greedy_match(o.token_ids, hf_greedy(tiny, p, n), label=o.request_id)
