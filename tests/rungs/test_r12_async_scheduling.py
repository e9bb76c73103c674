"""Rung 12's overlapped step (``async_scheduling=True``, engines/r12_realtime, notebook 12): tokens
(greedy and seeded, n > 1, beams) identical to the synchronous engine with preemption and prefix
caching; an abort while a forward is in flight ends the request once; a forward that fails resets
cleanly; the engines that cannot overlap refuse the option by name."""
from __future__ import annotations

from collections import Counter

import pytest

from minillm import Request, SamplingParams
from minillm.core.engine import PagedEngine
from minillm.core.executor import InlineExecutor
from minillm.engines import create_engine
from minillm.engines.r12_realtime.engine import ThreadExecutor
from minillm.lab.reference import mixed_requests
from minillm.request import FinishReason

from conftest import drain


def workload(seed: int = 0) -> list[Request]:
    return mixed_requests(seed)


def outputs(engine, reqs) -> dict:
    return {o.request_id: (o.samples, o.finish_reasons) for o in engine.run(reqs).outputs}


@pytest.mark.parametrize("options", [
    dict(num_blocks=18, block_size=4, max_num_seqs=6),                      # preempts
    dict(num_blocks=64, block_size=4, max_num_seqs=4, enable_prefix_caching=True,
         max_num_batched_tokens=24, policy="slo"),                          # chunks, prefix hits
])
def test_tokens_identical_to_the_synchronous_engine(tiny, options):
    sync = create_engine("paged", tiny, **options)
    overlapped = create_engine("paged", tiny, async_scheduling=True, **options)
    assert type(sync) is type(overlapped) is PagedEngine    # one engine; its executor differs
    assert isinstance(overlapped.executor, ThreadExecutor)
    want, got = outputs(sync, workload()), outputs(overlapped, workload())
    assert got == want
    assert overlapped.num_preemptions == sync.num_preemptions
    assert overlapped.prefix_hit_tokens == sync.prefix_hit_tokens
    if options["num_blocks"] == 18:
        assert sync.num_preemptions > 0
    for e in (sync, overlapped):
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    info = overlapped.describe()
    assert info["async_scheduling"] and info["overlap"]["steps"] > 0
    overlapped.close()


def test_abort_while_a_forward_is_in_flight_ends_the_request_once(tiny):
    engine = create_engine("paged", tiny, async_scheduling=True, num_blocks=32, block_size=4)
    reqs = workload()[:4]
    for r in reqs:
        engine.add_request(r)
    engine.step()                                   # launches the first forward
    assert engine.in_flight
    assert engine.abort("r1") and not engine.abort("r1") and not engine.abort("nope")
    finals = drain(engine, Counter())
    assert all(finals[r.request_id] == 1 for r in reqs)
    assert reqs[1].finish_reason is FinishReason.ABORT
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


def test_forward_and_sampling_run_on_one_thread_with_the_callers_thread_count(tiny):
    """Everything torch computes in an overlapped step -- the forward and the sampler -- runs on
    the forward's thread, with as many torch threads as the thread stepping the engine has: one
    OpenMP team. (The sampler on the caller's thread would make two teams; libgomp then stops its
    idle workers spinning, and served TPOT is ~2x: docs/rungs/12_realtime.md.)"""
    import threading

    import torch
    engine = create_engine("paged", tiny, async_scheduling=True, num_blocks=32, block_size=4)
    seen: list[tuple[str, str, int]] = []

    def probe(what, fn):
        def wrapped(*args):
            seen.append((what, threading.current_thread().name, torch.get_num_threads()))
            return fn(*args)
        return wrapped
    engine.runner.run = probe("forward", engine.runner.run)     # the test's own probes
    engine.sampler = probe("sample", engine.sampler)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            seen.clear()
            assert len(engine.run(workload()[:3]).outputs) == 3
            assert {w for w, _, _ in seen} == {"forward", "sample"}
            assert all(name.startswith("minillm-forward") and n == threads
                       for _, name, n in seen), seen
    finally:
        torch.set_num_threads(before)
        engine.close()


def test_the_callers_idle_openmp_threads_are_let_go_and_torch_still_computes():
    """Before each launch the caller's idle OpenMP threads go (``omp_pause_resource_all`` of the
    runtime torch loaded; found on Linux wherever torch runs on OpenMP); torch computes the same
    after, its threads coming back at its next parallel op."""
    import sys

    import torch
    from minillm.engines.r12_realtime.engine import release_idle_openmp_threads
    a = torch.randn(384, 384, generator=torch.Generator().manual_seed(0))
    want = a @ a
    released = release_idle_openmp_threads()
    if sys.platform == "linux" and "OpenMP" in torch.__config__.parallel_info():
        assert released
    assert torch.allclose(a @ a, want) and release_idle_openmp_threads() == released


class Boom(RuntimeError):
    pass


def test_a_failing_forward_is_raised_and_the_engine_resets(tiny):
    engine = create_engine("paged", tiny, async_scheduling=True, num_blocks=32, block_size=4)
    real_run, calls = engine.runner.run, []

    def flaky(scheduled):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("forward failed")
        return real_run(scheduled)

    engine.runner.run = flaky                       # the test's own fault injection
    with pytest.raises(Boom):
        engine.run(workload()[:3])
    assert not engine.in_flight and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.runner.run = real_run
    assert len(engine.run(workload()[:2]).outputs) == 2
    engine.close()


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("options", [
    dict(num_blocks=20, block_size=4, max_num_seqs=6),                      # preempts
    dict(num_blocks=64, block_size=4, max_num_seqs=4, enable_prefix_caching=True,
         max_num_batched_tokens=24),                                        # chunks, prefix hits
])
def test_speculative_decoding_overlapped_gives_the_synchronous_tokens(tiny, method, options):
    """Rung 6 under rung 12: guesses proposed after a step lands, verified when the next lands;
    greedy and seeded tokens, preemptions and prefix hits as the synchronous speculative engine,
    and the draft's guesses really made and kept."""
    sync = create_engine("paged", tiny, speculative=method, **options)
    overlapped = create_engine("paged", tiny, speculative=method, async_scheduling=True,
                               **options)
    assert type(overlapped) is type(sync) and overlapped.name == sync.name      # no combination class
    assert isinstance(overlapped.executor, ThreadExecutor)
    reqs = workload() + [Request([5, 6, 7, 5, 6, 7, 5, 6] * 2, SamplingParams(
        max_tokens=24, ignore_eos=True), request_id="copy")]          # the n-gram's food
    want = outputs(sync, reqs)
    got = outputs(overlapped, workload() + [Request(reqs[-1].prompt_token_ids, SamplingParams(
        max_tokens=24, ignore_eos=True), request_id="copy")])
    assert got == want
    assert overlapped.num_preemptions == sync.num_preemptions
    assert overlapped.prefix_hit_tokens == sync.prefix_hit_tokens
    assert overlapped.run_stats.num_proposed == sync.run_stats.num_proposed
    assert overlapped.run_stats.num_accepted == sync.run_stats.num_accepted
    # (the random model seldom repeats itself, so the n-gram seldom guesses; the draft always does)
    assert method == "ngram" or sync.run_stats.num_accepted > 0, sync.run_stats
    assert overlapped.block_manager.num_free_blocks == overlapped.block_manager.num_blocks
    overlapped.close()


@pytest.mark.parametrize("extra", [dict(pipeline_parallel_size=2),
                                   dict(tensor_parallel_size=2)])
def test_engines_that_cannot_overlap_refuse_it_by_name(tiny, extra):
    if tiny.device.type == "cuda":
        pytest.skip("on GPUs, spawned workers are refused first (one process per GPU: torchrun)")
    with pytest.raises(ValueError, match="async_scheduling"):
        create_engine("paged", tiny, async_scheduling=True, num_blocks=16, **extra)


def test_async_scheduling_false_is_the_plain_engine(tiny):
    engine = create_engine("paged", tiny, async_scheduling=False, num_blocks=8)
    assert type(engine) is PagedEngine and type(engine.executor) is InlineExecutor
