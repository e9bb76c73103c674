"""Rung 10 on torch.distributed (gloo on CPU): T = 2 ranks (each its own KV head of tiny-llama),
T = 4 (more ranks than KV heads: each replicated on two), and T = 2 x P = 2 (4 ranks) give the
single-process paged engine's tokens, token for token -- n > 1, beams, preemption, prefix
caching -- and aborts, a real Ctrl-C and a killed worker leave no request, block or process
behind. Engines are launched once per module (starting ranks dominates the time)."""
from __future__ import annotations

import os
import signal
import threading
from collections import Counter

import pytest
import torch

from minillm import LLM, FinishReason, SamplingParams
from minillm.engines import create_engine, resolve
from minillm.dist.comm import WorkerError
from minillm.engines.r7_pipeline.stage import EXIT_HOOK_ENV
from minillm.engines.r10_tensor.engine import TensorParallelEngine
from minillm.engines.r10_tensor.timeline import summarize
from minillm.lab.reference import random_prompts
from test_r07_pipeline import ROOMY, TIGHT, assert_same_as_paged, requests, shared_prefix_prompts

# slow: worker processes per engine: not in make test-fast. One xdist group (`--dist loadgroup`): under
# `make test` (two xdist workers), two files of worker ranks at once (7 processes on 2 cores) once
# left a group unformed after 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ranks")]

MIXED = [SamplingParams(max_tokens=8, ignore_eos=True),
         SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=3, ignore_eos=True),
         SamplingParams(max_tokens=5, beam_width=2, ignore_eos=True),
         SamplingParams(max_tokens=7, temperature=0.8, top_k=20, seed=1)]


@pytest.fixture(scope="module")
def tp2(tiny):
    engine = TensorParallelEngine(tiny, tensor_parallel_size=2, **TIGHT)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tp2_roomy(tiny):
    engine = TensorParallelEngine(tiny, tensor_parallel_size=2, **ROOMY)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tp2pp2(tiny):
    engine = TensorParallelEngine(tiny, tensor_parallel_size=2, pipeline_parallel_size=2,
                                  num_microbatches=1, **TIGHT)
    yield engine
    engine.close()


def test_options_lead_to_rung_10(tiny):
    assert resolve("paged", {"tensor_parallel_size": 2})[0].name == "tensor"
    spec, options, _ = resolve("paged", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2})
    assert spec.name == "tensor" and options["pipeline_parallel_size"] == 2
    with pytest.raises(ValueError, match="at least 2 ranks"):
        create_engine("paged", tiny, tensor_parallel_size=1)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's 4"):
        create_engine("paged", tiny, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer, got .2."):
        create_engine("paged", tiny, tensor_parallel_size="2")


def test_two_ranks_equal_single_process_with_preemption_and_prefix_hits(tp2, tiny):
    before = (tp2.num_preemptions, tp2.prefix_hit_tokens)
    assert_same_as_paged(tp2, tiny, shared_prefix_prompts(8, seed=90), MIXED * 2, **TIGHT)
    assert tp2.num_preemptions > before[0], "the tight pool must force preemption"
    assert tp2.prefix_hit_tokens > before[1], "the shared prefix must hit the cache"


def test_each_rank_holds_its_kv_heads_of_every_block(tp2, tiny):
    kv = tp2.runner.pool.caches[0][0]            # rank 0, layer 0, K: [blocks, block, heads, D]
    assert kv.shape[2] == 1 and tp2.runner.net.num_heads == 2    # of 2 KV and 4 query heads
    assert tp2.block_manager.num_blocks == TIGHT["num_blocks"] == kv.shape[0]
    assert tp2.kv_bytes_per_rank() == [tp2.kv_bytes_per_token // 2] * 2


def test_four_ranks_replicate_kv_heads_and_equal_single_process(tiny):
    engine = TensorParallelEngine(tiny, tensor_parallel_size=4, **ROOMY)
    try:
        assert engine.runner.heads.kv_replicas == 2
        assert engine.kv_bytes_per_rank() == [engine.kv_bytes_per_token // 2] * 4
        assert_same_as_paged(engine, tiny, random_prompts(6, seed=91), MIXED + MIXED[:2], **ROOMY)
    finally:
        engine.close()


def test_two_by_two_ranks_equal_single_process(tp2pp2, tiny):
    assert tp2pp2.world_size == 4 and tp2pp2.kv_bytes_per_rank() == [tp2pp2.kv_bytes_per_token // 4] * 4
    before = tp2pp2.num_preemptions
    assert_same_as_paged(tp2pp2, tiny, shared_prefix_prompts(8, seed=92), MIXED * 2, **TIGHT)
    assert tp2pp2.num_preemptions > before


def test_timeline_has_two_all_reduces_per_layer_and_step_on_every_rank(tp2, tiny):
    tp2.clear_timeline()
    before = tp2.num_launched
    tp2.run(requests(random_prompts(4, seed=93), SamplingParams(max_tokens=5, ignore_eos=True),
                     "tl"))
    events, steps = tp2.timeline(), tp2.num_launched - before
    layers = len(tiny.hf_model.model.layers)
    for rank in (0, 1):
        assert sum(e.kind == "all_reduce" and e.rank == rank for e in events) == 2 * layers * steps
    for r in summarize(events):       # all-reduce time is taken out of compute, never counted twice
        assert r.seconds["all_reduce"] > 0 and r.seconds["compute"] > 0
        assert sum(r.seconds.values()) == pytest.approx(r.window_s)


def test_abort_and_real_ctrl_c_leave_ranks_in_step(tp2_roomy, tiny):
    reqs, finals = requests(random_prompts(6, seed=94), SamplingParams(max_tokens=20,
                                                                        ignore_eos=True), "ab"), Counter()
    for r in reqs:
        tp2_roomy.add_request(r)
    for _ in range(3):
        finals.update(r.request_id for r in tp2_roomy.step().finished)
    assert tp2_roomy.abort("ab-0") and tp2_roomy.abort("ab-3")
    finals.update(r.request_id for r in tp2_roomy.step().finished)
    finals.update(r.request_id for r in tp2_roomy.reset())
    assert finals == Counter(r.request_id for r in reqs), "every request ends exactly once"
    assert reqs[0].finish_reason == reqs[3].finish_reason == FinishReason.ABORT
    for delay_s in (0.05, 0.3):
        reqs = requests(random_prompts(6, seed=95), SamplingParams(max_tokens=400,
                                                                    ignore_eos=True), f"int{delay_s}")
        timer = threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                tp2_roomy.run(reqs)
        finally:
            timer.join()
        assert all(r.finished for r in reqs) and not tp2_roomy.groups
        assert tp2_roomy.block_manager.num_free_blocks == tp2_roomy.block_manager.num_blocks
    assert_same_as_paged(tp2_roomy, tiny, random_prompts(3, seed=96), SamplingParams(max_tokens=5),
                         **ROOMY)


@pytest.mark.parametrize("world", [dict(tensor_parallel_size=2),
                                   dict(tensor_parallel_size=2, pipeline_parallel_size=2)])
def test_killed_worker_is_a_clear_error_and_no_process_is_left(tiny, world):
    llm = LLM(tiny, **world, pipeline_timeout_s=5)
    engine = llm.engine
    procs = dict(engine.group.processes)
    victim = max(procs)

    def kill(snapshot, record):
        if record.step == 3:
            os.kill(procs[victim].pid, signal.SIGKILL)
    reqs = llm.make_requests(random_prompts(6, seed=97), SamplingParams(max_tokens=30,
                                                                        ignore_eos=True))
    with pytest.raises(WorkerError, match=rf"worker rank {victim} \(pid \d+\) exited with code -9"):
        llm.run(reqs, on_step=kill)
    assert all(r.finished for r in reqs)
    assert not any(p.is_alive() for p in procs.values())       # the others were stopped too
    with pytest.raises(WorkerError):
        engine.step()
    engine.close()


def test_worker_exiting_mid_all_reduce_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.setenv(EXIT_HOOK_ENV, "1:2")        # rank 1 calls os._exit(3) after 2 steps
    engine = TensorParallelEngine(tiny, tensor_parallel_size=2, pipeline_timeout_s=5)
    procs = dict(engine.group.processes)
    reqs = requests(random_prompts(4, seed=98), SamplingParams(max_tokens=30, ignore_eos=True),
                    "die")
    with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) exited with code 3"):
        engine.run(reqs)
    assert not any(p.is_alive() for p in procs.values()) and all(r.finished for r in reqs)
    engine.close()


@pytest.mark.slow
def test_torchrun_cli_equals_single_process_cli(tmp_path):
    """`torchrun --nproc-per-node 4 -m minillm generate --tensor-parallel 2 --pipeline-parallel 2`
    (rank 0 writes --out, ranks 1-3 serve their shards) writes the single-process CLI's tokens."""
    import json
    import subprocess
    import sys

    from test_r07_pipeline import free_port

    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt_token_ids": [5, 6, 7], "n": 2, '
                       '"temperature": 1.0, "seed": 3}\n{"prompt": "heads", "beam_width": 2}\n')
    # fp32: in bf16 each rank's partial product is rounded before the all-reduce sums them, so
    # tensor-parallel tokens may differ from one process's (the pipeline's do not: no split sums)
    common = ["-m", "minillm", "generate", "--model", "tiny-llama", "--prompts", str(prompts),
              "--max-tokens", "8", "--quiet", "--dtype", "float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = subprocess.run([sys.executable, *common, "--out", str(tmp_path / "one.jsonl")],
                            capture_output=True, text=True, timeout=180, env=env)
    assert single.returncode == 0, single.stderr
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          *common, "--tensor-parallel", "2", "--pipeline-parallel", "2",
                          "--out", str(tmp_path / "tp.jsonl")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]

    def rows(name):
        return [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
    keep = ("id", "token_ids", "finish_reason", "samples")
    assert [{k: r.get(k) for k in keep} for r in rows("tp.jsonl")] == \
        [{k: r.get(k) for k in keep} for r in rows("one.jsonl")]
    assert len(rows("tp.jsonl")) == 3


def test_the_stage_groups_collective_all_reduce_gives_the_same_tokens(tiny):
    with pytest.raises(ValueError, match="all_reduce must be one of auto, collective, exchange"):
        create_engine("paged", tiny, tensor_parallel_size=2, all_reduce="ring")
    engine = TensorParallelEngine(tiny, tensor_parallel_size=2, pipeline_parallel_size=2,
                                  all_reduce="collective", **TIGHT)
    try:
        assert engine.runner.all_reduce.how == "collective" and engine.runner.all_reduce.pg is not None
        assert_same_as_paged(engine, tiny, shared_prefix_prompts(6, seed=99), MIXED + MIXED[:2],
                             **TIGHT)
    finally:
        engine.close()


def test_quantized_kv_cache_splits_by_heads_too(tiny):
    """Rung 9's int8 cache under rung 10: each rank quantizes its own heads' rows (a scale per
    token and head), so the tokens are the single-process int8 engine's."""
    engine = TensorParallelEngine(tiny, tensor_parallel_size=2, kv_cache_dtype="int8", **ROOMY)
    try:
        assert engine.kv_bytes_per_rank() == [engine.kv_bytes_per_token // 2] * 2
        assert_same_as_paged(engine, tiny, random_prompts(6, seed=100), MIXED + MIXED[:2],
                             kv_cache_dtype="int8", **ROOMY)
    finally:
        engine.close()


def test_auto_all_reduce_exchanges_small_tensors_on_cpu_only():
    from types import SimpleNamespace

    from minillm.engines.r10_tensor.shard import EXCHANGE_MAX_BYTES, AllReduce
    reduce = AllReduce("auto")
    reduce.connect(SimpleNamespace(device=torch.device("cpu")), range(2))
    small, big = torch.empty(EXCHANGE_MAX_BYTES // 4), torch.empty(EXCHANGE_MAX_BYTES // 4 + 1)
    assert reduce.exchanges(small) and not reduce.exchanges(big)
    reduce.connect(SimpleNamespace(device=torch.device("cuda")), range(2))
    assert not reduce.exchanges(small)
    assert AllReduce("exchange").exchanges(big) and not AllReduce("collective").exchanges(small)
    with pytest.raises(RuntimeError, match="not connected"):
        AllReduce()(small)


def test_rank_view_draws_each_ranks_bytes_of_the_same_slots(tp2_roomy):
    import matplotlib
    matplotlib.use("Agg")
    from minillm.viz.rank_view import RankMemoryView

    per_rank = tp2_roomy.kv_bytes_per_rank()
    view = RankMemoryView(per_rank, title="T=2")
    tp2_roomy.run(requests(random_prompts(3, seed=101), SamplingParams(max_tokens=6), "view"),
                  on_step=view)
    busy = view.last_busy()
    fig = view.figure(busy)
    bars = fig.axes[1].patches
    token_bars = bars[:len(per_rank)]          # the first kind drawn: token slots, one bar per rank
    want = [view.counts[busy].token * b / 2**20 for b in per_rank]
    assert [b.get_width() for b in token_bars] == pytest.approx(want) and want[0] > 0
    with pytest.raises(ValueError, match="bytes_per_rank"):
        RankMemoryView([])


def test_per_layer_times_come_from_the_spans(tp2, tiny):
    from minillm.engines.r10_tensor.timeline import per_layer, summarize
    tp2.clear_timeline()
    tp2.run(requests(random_prompts(3, seed=102), SamplingParams(max_tokens=4, ignore_eos=True),
                     "pl"))
    events = tp2.timeline()
    for rank in (0, 1):
        rows = per_layer(events, rank)
        assert len(rows) == len(tiny.hf_model.model.layers)
        assert all(v >= 0 for r in rows for v in r.values())
        steps = sum(1 for e in events if e.rank == rank and e.kind == "compute")
        reduces = sum(r["all_reduce_attention"] + r["all_reduce_mlp"] for r in rows) * steps
        whole = summarize(events)[rank].seconds["all_reduce"]
        assert reduces == pytest.approx(whole)     # every all-reduce is some layer's
