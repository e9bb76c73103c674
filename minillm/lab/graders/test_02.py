"""Exercise 02 — dynamic batching: ``DynamicBatchEngine._admit`` (join) and ``_compact`` (leave).

More requests than rows: newcomers join as soon as rows free up, finished requests leave at once.
The engine must keep its list of rows and its KV rectangle in step after every step, never run
more than ``max_num_seqs`` requests, end empty, and produce Hugging Face's tokens for each request.

Every call of your functions happens in your process (``probe_run``, the ``student`` fixture):
it sends back, after each step, the rows listed, the KV rectangle's rows and who still holds a row,
and the tokens; the tests judge that here, with Hugging Face run here as the reference.
"""
from __future__ import annotations

from minillm import SamplingParams
from minillm.engines.r2_dynamic import DynamicBatchEngine
from minillm.lab.reference import assert_greedy_match, hf_greedy, random_prompts
from minillm.request import Request

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)


def probe_run(prompts: list, lengths: list, max_num_seqs: int) -> dict:
    """The student's engine on these requests: per step (step, rows listed, KV rows or None,
    live requests, finished ones still holding a row); the tokens; what is left at the end."""
    import torch

    from minillm import load_model
    tiny = load_model("tiny-llama", dtype=torch.float32)
    engine = DynamicBatchEngine(tiny, max_num_seqs=max_num_seqs)
    reqs = [Request(p, SamplingParams(max_tokens=n, ignore_eos=True), request_id=f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    steps = []

    def after_step(snapshot, record):
        live = [r for r in engine.rows if r is not None]
        steps.append((int(record.step), len(engine.rows),
                      None if engine.kv is None else int(engine.kv.rows), len(live),
                      sum(bool(r.finished) for r in live)))

    result = engine.run(reqs, on_step=after_step)
    return {"steps": steps, "left": bool(engine.has_unfinished()) or any(
        r is not None for r in engine.rows),
        "outputs": [(o.request_id, o.error, [int(t) for t in o.token_ids]) for o in result.outputs]}


def run_checked(student, prompts, lengths, max_num_seqs) -> tuple[list, int]:
    run = student.run(probe_run, prompts, lengths, max_num_seqs)
    peak = 0
    for step, rows, kv_rows, live, finished in run["steps"]:
        assert kv_rows is None or kv_rows == rows, (
            f"after step {step}: {rows} rows listed but the KV rectangle has {kv_rows} — "
            "compaction must drop the same rows from both")
        assert finished == 0, f"after step {step}: a finished request still holds a row"
        assert live <= max_num_seqs, f"{live} requests running, max_num_seqs is {max_num_seqs}"
        peak = max(peak, live)
    assert not run["left"], "the engine must end with no request in its rows"
    assert len(run["outputs"]) == len(prompts), f"{len(run['outputs'])} outputs, {len(prompts)} requests"
    return run["outputs"], peak


def test_join_and_leave_equal_hf_generate(student, tiny):
    prompts = random_prompts(7, seed=21, lo=2, hi=30)
    lengths = [3, 12, 5, 9, 2, 7, 4]
    outputs, peak = run_checked(student, prompts, lengths, max_num_seqs=3)
    assert peak == 3, "with 7 requests and 3 rows, newcomers must fill every free row"
    for i, (p, n, (_, error, tokens)) in enumerate(zip(prompts, lengths, outputs)):
        assert error is None, error
        assert_greedy_match(tokens, hf_greedy(tiny, p, n), label=f"request r{i}")


def test_a_request_that_ends_at_once_never_takes_a_row(student, tiny):
    """max_tokens=1: done after its prefill token, it must finish without joining the batch."""
    prompts = random_prompts(4, seed=22, lo=2, hi=20)
    outputs, _ = run_checked(student, prompts, [1, 6, 1, 4], max_num_seqs=2)
    for p, n, (rid, _, tokens) in zip(prompts, [1, 6, 1, 4], outputs):
        assert_greedy_match(tokens, hf_greedy(tiny, p, n), label=rid)
