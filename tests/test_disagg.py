"""Rung 11, prefill/decode disaggregation (gloo on CPU): a prefill worker in another process, the
prompt's KV blocks moved into the decode worker's pool. Greedy and seeded outputs equal the paged
engine's token for token (prefix caching, preemption on the decode side, an int8 cache whose
scales travel with the blocks); n > 1 and beams are refused with a clear error; aborts at every
stage free blocks on both sides; a killed prefill worker is a clear error with no process left."""
from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

from minillm import FinishReason, SamplingParams
from minillm.engines.r7_pipeline.comm import PipelineError
from minillm.engines.r11_disagg.engine import DisaggEngine
from minillm.lab.reference import random_prompts
from minillm.request import RequestError
from test_pipeline import ROOMY, TIGHT, assert_same_as_paged, requests, shared_prefix_prompts

PARAMS = [SamplingParams(max_tokens=10, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=4),
          SamplingParams(max_tokens=5, temperature=1.0, seed=9, ignore_eos=True)]


@pytest.fixture(scope="module")
def roomy(tiny):
    engine = DisaggEngine(tiny, **ROOMY)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tight(tiny):
    # lockstep: one exchange per step, so the schedule (and its preemptions) is reproducible
    engine = DisaggEngine(tiny, lockstep=True, **TIGHT)
    yield engine
    engine.close()


def assert_pools_full(engine):
    assert not engine.prefilling and not engine.ready and not engine.pulling
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    free, total = engine.prefill_pool
    assert free == total, f"the prefill worker holds {total - free} blocks after the run"


def test_greedy_and_seeded_equal_the_paged_engine(roomy, tiny):
    prompts = random_prompts(9, seed=110) + [[7]]          # a one-token prompt: nothing to move
    assert_same_as_paged(roomy, tiny, prompts, PARAMS * 3 + PARAMS[:1], **ROOMY)
    assert_pools_full(roomy)
    moved = [t for rid, t in roomy.transfers.items() if t.landed]
    assert len(moved) >= 9 and all(t.nbytes == t.num_blocks * ROOMY["block_size"] *
                                   roomy.kv_bytes_per_token for t in moved)


def test_prefix_caching_and_preemption_on_the_decode_side(tight, tiny):
    before = tight.num_preemptions
    assert_same_as_paged(tight, tiny, shared_prefix_prompts(8, seed=111), PARAMS * 3,
                         **TIGHT)
    assert tight.num_preemptions > before, "the tight decode pool must preempt"
    assert_pools_full(tight)


def test_int8_blocks_travel_with_their_scales(tiny):
    engine = DisaggEngine(tiny, kv_cache_dtype="int8", **ROOMY)
    try:
        assert_same_as_paged(engine, tiny, random_prompts(6, seed=112), PARAMS * 2,
                             kv_cache_dtype="int8", **ROOMY)
        assert_pools_full(engine)
    finally:
        engine.close()


def test_parallel_samples_and_beams_are_refused_clearly(roomy):
    for params in (SamplingParams(n=2, temperature=1.0), SamplingParams(beam_width=2)):
        with pytest.raises(RequestError, match="n > 1 and beam search need the .paged. engine "
                                               ".this is .disagg.."):
            roomy.validate(requests([[5, 6, 7]], params, "bad")[0])


@pytest.mark.parametrize("when", ["queued", "prefilling", "ready", "decoding"])
def test_aborts_at_every_stage_free_both_pools(tight, tiny, when):
    reqs = requests(random_prompts(6, seed=113, lo=20, hi=30), SamplingParams(max_tokens=12,
                    ignore_eos=True), f"ab-{when}")
    finals = Counter()
    for r in reqs:
        tight.add_request(r)
    def stage(r):
        if any(rid == r.request_id for rid, _, _ in tight.command.new):
            return "queued"                        # not yet sent to the prefill worker
        return ("prefilling" if r.request_id in tight.prefilling else
                "ready" if r.request_id in tight.ready else
                "decoding" if r.request_id in tight.groups else None)
    target = None
    for _ in range(200):        # lockstep: the same steps reach the same stages on every run
        target = next((r for r in reqs if stage(r) == when), None)
        if target is not None:
            break
        finals.update(r.request_id for r in tight.step().finished)
    assert target is not None, f"no request was ever {when}"
    assert tight.abort(target.request_id)
    while tight.has_unfinished():
        finals.update(r.request_id for r in tight.step().finished)
    assert finals == Counter(r.request_id for r in reqs), "every request ends exactly once"
    assert target.finish_reason == FinishReason.ABORT
    assert_pools_full(tight)


def test_a_real_ctrl_c_leaves_both_workers_in_step(roomy, tiny):
    """A real SIGINT at a given step (from the step callback, so no wall clock decides where):
    the run raises KeyboardInterrupt, every request ends, both pools are full, the next run is
    exact."""
    for at in (2, 5, 40):
        def interrupt(snapshot, record):
            if record.step == at:
                os.kill(os.getpid(), signal.SIGINT)
        reqs = requests(random_prompts(6, seed=114), SamplingParams(max_tokens=400,
                                                                    ignore_eos=True), f"int{at}")
        with pytest.raises(KeyboardInterrupt):
            roomy.run(reqs, on_step=interrupt)
        assert all(r.finished for r in reqs) and not roomy.groups
    assert_same_as_paged(roomy, tiny, random_prompts(3, seed=115), SamplingParams(max_tokens=5),
                         **ROOMY)
    assert_pools_full(roomy)


def test_killed_prefill_worker_is_a_clear_error_and_no_process_is_left(tiny):
    engine = DisaggEngine(tiny, transfer_timeout_s=5, **ROOMY)
    proc = engine.group.processes[1]

    def kill(snapshot, record):
        if record.step == 2:
            os.kill(proc.pid, signal.SIGKILL)
    reqs = requests(random_prompts(6, seed=116), SamplingParams(max_tokens=30, ignore_eos=True),
                    "die")
    with pytest.raises(PipelineError, match=r"prefill worker rank 1 \(pid \d+\) exited with "
                                            r"code -9"):
        engine.run(reqs, on_step=kill)
    assert all(r.finished for r in reqs) and not proc.is_alive()
    with pytest.raises(PipelineError):
        engine.step()
    engine.close()


def test_abort_while_its_blocks_are_on_the_way(tight, tiny):
    """A transfer lands within the step that pulled it; an abort that comes in between (here
    from an observer, as a server thread's would between steps of a threaded engine) drops the
    blocks when they arrive, acknowledges them, and frees both sides."""
    hit = []

    def abort_in_flight(event):
        if event.phase == "computed" and tight.pulling and not hit:
            hit.append(next(iter(tight.pulling)))
            assert tight.abort(hit[0])
    reqs = requests(random_prompts(5, seed=117), SamplingParams(max_tokens=8, ignore_eos=True),
                    "fly")
    with tight.observers.watching(abort_in_flight):
        result = tight.run(reqs)
    assert hit, "no step computed while blocks were on the way"
    aborted = {o.request_id for o in result.outputs if o.finish_reason == FinishReason.ABORT}
    assert aborted == set(hit) and hit[0] not in tight.transfers
    assert_pools_full(tight)


def test_overlapped_and_lockstep_give_the_same_tokens(tiny):
    """By default the decodes never wait for a prefill step (the reply is read once it is in):
    the schedule then depends on timing, the tokens do not."""
    engine = DisaggEngine(tiny, **TIGHT)
    try:
        assert_same_as_paged(engine, tiny, shared_prefix_prompts(8, seed=118), PARAMS * 3,
                             **TIGHT)
        assert_pools_full(engine)
    finally:
        engine.close()


def test_short_prompts_are_prefilled_where_they_decode(tiny):
    """``local_prefill_max_tokens``: prompts that short never go to the prefill worker (no
    transfer), the longer ones do; the tokens are the paged engine's either way."""
    engine = DisaggEngine(tiny, local_prefill_max_tokens=12, **ROOMY)
    try:
        prompts = random_prompts(8, seed=119, lo=4, hi=30)
        got = assert_same_as_paged(engine, tiny, prompts, PARAMS * 3, **ROOMY)
        moved = {rid for rid, t in engine.transfers.items() if t.landed}
        long_ones = {o.request_id for o, p in zip(got.outputs, prompts) if len(p) > 12}
        assert moved == long_ones and 0 < len(long_ones) < len(prompts)
        assert_pools_full(engine)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="local_prefill_max_tokens must be an integer >= 0"):
        DisaggEngine(tiny, local_prefill_max_tokens=-1)
