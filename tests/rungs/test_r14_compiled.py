"""Rung 14: the compiled decode step (engines/r14_compiled) and int8 weights on the real model.

The bucketing rule and the options are checked statically; the compiled engine is checked token
for token against the eager paged engine on the tiny model in fp32 (greedy at batch sizes padded to
the bucket, seeded n > 1, preemption in a tight pool), and so is the dynamic graph that runs the
batches past the last bucket. Compiling takes tens of seconds per graph on a busy 2-core machine
(seconds once inductor's disk cache has it), so those tests are ``slow`` and share one engine
with one bucket, and one with the dynamic graph."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from minillm import LLM, SamplingParams
from minillm.engines import create_engine, resolve
from minillm.engines.r14_compiled.config import (DEFAULT_BUCKETS, CompileConfig, bucket_for,
                                                 parse_buckets)
from minillm.engines.r14_compiled.graph import GraphLinear
from minillm.engines.r14_compiled.ops import load_step_linear
from minillm.layers import tiled
from minillm.layers.attention.cpp import cpp_available
from minillm.layers.quant import w8a8_missing

# one bucket: every decode batch of these tests (1 to 8 rows) is padded to 8, so the module
# compiles one graph (~100 s on a busy 2-core machine, cold); which bucket a batch gets is
# checked without compiling (test_bucket_is_the_smallest_that_holds_the_batch)
BUCKETS = "8"
TIGHT = {"block_size": 4, "num_blocks": 20, "max_num_seqs": 8}
# the compiled engine's default product kernel (engine.py: ``tiled`` where it is the faster one):
# each eager twin runs the same one, so both sum the same products in the same order
KERNEL = {"linear_backend": "tiled"} if tiled.preferred("cpu", torch.float32) else {}


def eager(model, **kw):
    return LLM(model, engine="paged", **KERNEL, **kw)


@pytest.mark.parametrize("buckets", [DEFAULT_BUCKETS, (1, 3, 8), (4,)])
def test_bucket_is_the_smallest_that_holds_the_batch(buckets):
    for n in range(1, buckets[-1] + 1):
        b = bucket_for(n, buckets)
        assert b >= n, f"bucket {b} smaller than the batch {n}"
        assert b == min(x for x in buckets if x >= n)
    assert bucket_for(buckets[-1] + 1, buckets) is None       # larger than all: eager
    with pytest.raises(ValueError):
        bucket_for(0, buckets)


def test_options_checked_by_name():
    assert parse_buckets("1, 2;8") == (1, 2, 8) and CompileConfig(True).buckets == DEFAULT_BUCKETS
    for bad, match in [("1,x", "compile_buckets must be positive"), ("0,2", "positive"),
                       ("4,2", "compile_buckets must increase")]:
        with pytest.raises(ValueError, match=match):
            CompileConfig(True, bad)
    with pytest.raises(ValueError, match="compile_wrapper must be one of 'python', 'cpp', got 'c'"):
        CompileConfig(True, compile_wrapper="c")
    with pytest.raises(ValueError, match="compile_large_batches must be one of 'dynamic', "
                                         "'eager', got 'padded'"):
        CompileConfig(True, compile_large_batches="padded")
    with pytest.raises(ValueError, match="compile must be True"):
        CompileConfig(False)
    with pytest.raises(ValueError, match="compile must be True or False"):
        CompileConfig("yes")
    spec, _, fixed = resolve("paged", {"compile": True})
    assert spec.name == "compiled" and spec.rung == 14 and fixed == {"compile": True}


def test_engine_builds_without_compiling(tiny):
    """Nothing compiles until the first decode step; a prefill-only step runs eagerly."""
    engine = create_engine("paged", tiny, compile=True, compile_buckets="2", **TIGHT)
    assert engine.name == "compiled" and engine.runner.compile_s == {}
    assert engine.describe()["compile_buckets"] == "2"


@pytest.fixture(scope="module")
def pair(tiny):
    """(compiled, eager): the same options, a pool tight enough to preempt."""
    return (LLM(tiny, engine="paged", compile=True, compile_buckets=BUCKETS, **TIGHT),
            eager(tiny, **TIGHT))


def run_both(pair, prompts, params):
    compiled, eager = pair
    got = [o.samples or [o.token_ids] for o in compiled.generate(prompts, params, progress=False)]
    want = [o.samples or [o.token_ids] for o in eager.generate(prompts, params, progress=False)]
    return got, want


@pytest.mark.slow
@pytest.mark.parametrize("n_prompts", [1, 3, 5])
def test_compiled_greedy_equals_eager(pair, n_prompts):
    prompts = random_prompts(n_prompts, seed=n_prompts, lo=3, hi=12)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got, want = run_both(pair, prompts, params)
    assert got == want
    runner = pair[0].engine.runner
    assert runner.steps["compiled"] > 0 and runner.native     # the C++ attention operator
    packed = [m for m in runner.graph.modules() if isinstance(m, GraphLinear) and
              m.index is not None]
    if KERNEL:          # the tiles: plain panels, traced inline, nothing packed by oneDNN
        assert pair[0].engine.describe()["linear_kernel"] == "tiled" and not packed
    elif load_step_linear() is not None:                # oneDNN's, through the C++ operator
        assert packed and all(m.native for m in packed)
        assert runner.graph.linear_table is not None
    assert set(runner.compile_s) <= set(parse_buckets(BUCKETS))


@pytest.mark.slow
def test_compiled_preempts_and_forks_like_eager(pair):
    """Seeded n = 3 sampling beside greedy requests in a pool too small for all: preemption
    (recomputed prompts run eagerly, their decodes compiled) and forked samples agree."""
    compiled, eager = pair
    before = (compiled.engine.num_preemptions, eager.engine.num_preemptions)
    prompts = random_prompts(6, seed=11, lo=8, hi=16)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got, want = run_both(pair, prompts, greedy)
    assert got == want
    assert compiled.engine.num_preemptions - before[0] > 0, "the pool was not tight enough"
    assert compiled.engine.num_preemptions - before[0] == eager.engine.num_preemptions - before[1]
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
    got, want = run_both(pair, prompts[:2], sampled)
    assert got == want and all(len(o) == 3 for o in got)


def test_a_batch_past_the_buckets_runs_eagerly_when_asked(tiny):
    """``compile_large_batches="eager"``: three decodes with bucket 2 compile nothing, run rung
    3's step, and give the eager engine's tokens."""
    compiled = LLM(tiny, engine="paged", compile=True, compile_buckets="2",
                   compile_large_batches="eager", **TIGHT)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = random_prompts(3, seed=3, lo=3, hi=8)
    got, want = run_both((compiled, eager(tiny, **TIGHT)), prompts, params)
    runner = compiled.engine.runner
    assert got == want and runner.compile_s == {} and runner.steps["compiled"] == 0
    assert runner.steps["eager"] >= 5 and compiled.engine.describe()["compile_large_batches"] \
        == "eager"


# a pool that holds 16 sequences, tight enough to preempt the longer runs below
ROOMY = {"block_size": 4, "num_blocks": 80, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def dynamic_pair(tiny):
    """(compiled, eager) with bucket 2 and the dynamic graph from 9 rows (never under 9, where an
    eager product may stream its weight), both compiled by the engine's warm-up."""
    compiled = LLM(tiny, engine="paged", compile=True, compile_buckets="2", **ROOMY)
    lines: list[str] = []
    compiled.engine.runner.progress = lines.append
    compiled.engine.warm_up()
    assert set(compiled.engine.runner.compile_s) == {2, "9+"}, lines
    assert any("batch 9+" in line and "then any batch" in line for line in lines), lines
    return compiled, eager(tiny, **ROOMY)


def spy_on_calls(runner) -> list:
    """(bucket, real rows, rows in, logits rows) of each compiled call, appended as they run."""
    seen, call = [], runner.call

    def spy(bucket, ids, pos, ctx):
        logits = call(bucket, ids, pos, ctx)
        seen.append((bucket, ctx.rows, ids.shape[0], logits.shape[0]))
        return logits
    runner.call = spy
    return seen


@pytest.mark.slow
def test_one_dynamic_graph_runs_every_batch_past_the_buckets_unpadded(dynamic_pair):
    """Batches of 3 (eager: between bucket 2 and 9), 9, 12 and 16 decodes: the three large ones
    run the graph the warm-up compiled at 9 rows, with no recompile (an error here) and no
    padding -- one logits row per sequence -- and the tokens are the eager engine's."""
    compiled, _ = dynamic_pair
    runner = compiled.engine.runner
    seen = spy_on_calls(runner)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for n in (3, 9, 12, 16):
                got, want = run_both(dynamic_pair, random_prompts(n, seed=50 + n, lo=3, hi=9),
                                     params)
                assert got == want, n
    finally:
        del runner.call
    dynamic = [(rows, into, out) for bucket, rows, into, out in seen if bucket is None]
    assert {rows for rows, _, _ in dynamic} >= {9, 12, 16}
    assert all(rows == into == out for rows, into, out in dynamic), dynamic     # unpadded
    assert all(rows <= 2 or rows >= 9 for _, rows, _, _ in seen), seen          # 3-8: eager
    assert set(runner.compile_s) == {2, "9+"}


@pytest.mark.slow
def test_the_dynamic_graph_preempts_and_forks_like_eager(dynamic_pair):
    """Seeded n = 3 samples and greedy requests in a pool too small for all: the batch grows and
    shrinks across bucket 2, eager steps and the dynamic graph; every token is the eager
    engine's."""
    compiled, eager = dynamic_pair
    before = compiled.engine.num_preemptions
    prompts = random_prompts(16, seed=12, lo=8, hi=16)
    got, want = run_both(dynamic_pair, prompts,
                         SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert got == want and compiled.engine.num_preemptions > before
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
    got, want = run_both(dynamic_pair, prompts[:4], sampled)
    assert got == want and all(len(o) == 3 for o in got)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,kw", [("float32", {"linear_backend": "gemv"}),
                                      ("bfloat16", {"quantization": "int8"})])
def test_the_dynamic_graph_with_kernels_chosen_by_row_count(tiny, dtype, kw):
    """The streamed product (up to 8 rows) and int8's int8pack path (bf16, up to 16 rows) are
    picked by the row count, which in the dynamic graph is a symbol: the graph takes the large
    rows' kernel with no guard on it, so batches of 12 and 20 share one graph (a guard would have
    contradicted the marked range: a ConstraintViolationError). In fp32 the tokens are the eager
    engine's; bf16 int8 runs int8pack eagerly at 12 rows, so there only the graph is checked."""
    from minillm.models import load_model
    model = tiny if dtype == "float32" else load_model("tiny-llama", dtype=torch.bfloat16)
    opts = {"block_size": 4, "num_blocks": 120, "max_num_seqs": 20}
    compiled = LLM(model, engine="paged", compile=True, compile_buckets="2", **opts, **kw)
    compiled.engine.warm_up()
    seen = spy_on_calls(compiled.engine.runner)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eager = LLM(model, engine="paged", **opts, **kw)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (12, 20):
            got, want = run_both((compiled, eager), random_prompts(n, seed=n, lo=3, hi=7), params)
            assert len(got) == n and all(len(o[0]) == 4 for o in got)
            if dtype == "float32":
                assert got == want, n
    assert {rows for bucket, rows, _, _ in seen if bucket is None} >= {12, 20}
    assert set(compiled.engine.runner.compile_s) == {2, "9+"}


@pytest.mark.slow
def test_smollm2_int8_greedy_agrees_with_fp32(smol):
    """SmolLM2 on int8 weights (weight-only, per channel) against its fp32 weights: 8 chat
    prompts x 32 greedy tokens. Measured: see docs/rungs/14_compiled.md (quant_accuracy)."""
    from minillm.bench.kv_accuracy import greedy_outputs
    from minillm.workload import load_prompts

    model = smol if smol.dtype == torch.float32 else None
    if model is None:
        pytest.skip("the fp32 reference needs the fp32 model")
    prompts = [{"messages": p["messages"]} for p in load_prompts()[:8]]
    ref = greedy_outputs(model, prompts, "auto", 32)
    got = greedy_outputs(model, prompts, "auto", 32, quantization="int8")
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    prefix = sum(next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
                 for r, g in zip(ref, got))
    total = sum(len(r) for r in ref)
    print(f"int8 vs fp32: {prefix}/{total} tokens before the first divergence, {same} equal")
    assert prefix / total >= MIN_PREFIX_SHARE


# the share of greedy tokens before each prompt's first divergence from fp32 that int8 weights
# must keep: measured 194/256 = 0.76 on the AVX2 lab host (dequant path); a flip at a near-tie
# ends a prompt's run early, so the bound leaves room for another CPU's rounding
MIN_PREFIX_SHARE = 0.6


@pytest.mark.slow
@pytest.mark.parametrize("quantization,wrapper", [("int8", "cpp"), ("w8a8", "python")])
def test_compiled_int8_equals_eager_int8(tiny, quantization, wrapper):
    """int8 weights in the compiled step: decode rows the streamed kernels compute
    (layers/gemv.py) are ``minillm::gemv`` / ``gemv_w8a8`` nodes, other rows packed_linear ops or
    traced torch ops; either way the tokens are the eager engine's on the same weights. One case
    in each wrapper (``compile_wrapper``): inductor's C++ wrapper calls the same kernels and
    operators with no Python between them, and must give the same tokens."""
    if quantization == "w8a8" and w8a8_missing() is not None:
        pytest.skip(w8a8_missing())
    kw = {"quantization": quantization, **TIGHT}
    compiled = LLM(tiny, engine="paged", compile=True, compile_buckets=BUCKETS,
                   compile_wrapper=wrapper, **kw)
    eager = LLM(tiny, engine="paged", **kw)
    got, want = run_both((compiled, eager), random_prompts(3, seed=4, lo=3, hi=12),
                         SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    described = compiled.engine.describe()
    assert got == want and described["compiled_steps"] > 0
    assert described["compile_wrapper"] == wrapper


@pytest.mark.slow
def test_compiled_on_a_16_bit_pool_calls_the_c_operator_and_equals_eager(tiny):
    """An fp32 model on rung 9's float16 pool (what llama.cpp keeps beside f32 weights): the
    compiled step's attention is the C++ operator, not the Python op (~140 us a layer), and the
    tokens are the eager engine's."""
    kw = {"kv_cache_dtype": "float16", **TIGHT}
    compiled = LLM(tiny, engine="paged", compile=True, compile_buckets=BUCKETS, **kw)
    got, want = run_both((compiled, eager(tiny, **kw)), random_prompts(3, seed=9, lo=3, hi=12),
                         SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert got == want and compiled.engine.runner.steps["compiled"] > 0
    assert compiled.engine.runner.native == cpp_available()


@pytest.mark.slow
def test_each_bucket_gets_its_graph_with_the_module_guards_skipped(tiny):
    """The compiled call keeps only its inputs' guards (runner.py: the weights never change):
    a batch of 2 after a batch of 1 still finds (compiles) bucket 2's graph, and 1 finds its own
    again; every step's tokens are the eager engine's."""
    compiled = LLM(tiny, engine="paged", compile=True, compile_buckets="1,2")
    twin = eager(tiny)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for n in (1, 2, 1):
        prompts = random_prompts(n, seed=n, lo=3, hi=8)
        got, want = run_both((compiled, twin), prompts, params)
        assert got == want
    runner = compiled.engine.runner
    assert set(runner.compile_s) == {1, 2} and runner.steps["compiled"] >= 3 * 5


@pytest.mark.slow
def test_engines_in_one_process_each_run_their_own_graph(tiny):
    """The module guards are skipped (runner.py), so each engine's graph has its own code object:
    an fp32, a bf16 and an int8 engine built one after another in one process each decode as
    their eager twins (a bf16 engine once ran the fp32 engine's graph: index_copy_'s dtypes). An
    int8 KV pool (rung 9) keeps the Python attention op, the others take the C++ operator."""
    from minillm.models import load_model
    bf16 = load_model("tiny-llama", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = random_prompts(2, seed=21, lo=3, hi=8)
    for model, kw in ((tiny, {}), (bf16, {}), (tiny, {"quantization": "int8"}),
                      (tiny, {"kv_cache_dtype": "int8"}), (tiny, {})):
        compiled = LLM(model, engine="paged", compile=True, compile_buckets="2", **kw)
        got, want = run_both((compiled, LLM(model, engine="paged", **kw)), prompts, params)
        assert got == want, (model.dtype, kw)
        runner = compiled.engine.runner
        assert runner.steps["compiled"] > 0
        assert runner.native == ("kv_cache_dtype" not in kw and cpp_available()), kw


@pytest.mark.slow
def test_two_threads_each_with_a_compiled_engine_decode_as_eager(tiny):
    """The C++ attention operator's step context is a thread's own: an fp32 and a bf16 engine,
    compiled, decoding at the same time in two threads each equal their eager twin."""
    import threading

    from minillm.models import load_model
    bf16 = load_model("tiny-llama", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engines = {m.dtype: (LLM(m, engine="paged", compile=True, compile_buckets="2"),
                         LLM(m, engine="paged")) for m in (tiny, bf16)}
    results: dict = {}

    def decode(dtype):
        try:
            for seed in range(3):
                prompts = random_prompts(2, seed=30 + seed, lo=3, hi=8)
                got, want = run_both(engines[dtype], prompts, params)
                results.setdefault(dtype, []).append(got == want)
        except Exception as e:      # reported below, not lost in the thread
            results[dtype] = [repr(e)]

    threads = [threading.Thread(target=decode, args=(d,)) for d in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()        # a hang is pytest-timeout's (pyproject.toml), not a clock of ours
    assert results == {d: [True] * 3 for d in engines}
    assert all(c.engine.runner.native == cpp_available() for c, _ in engines.values())


@pytest.mark.slow
def test_async_scheduling_with_a_compiled_step(tiny):
    """Rung 12's worker thread runs the compiled forwards (and sets the operator's context there):
    the greedy tokens are the eager engine's."""
    compiled = LLM(tiny, engine="paged", compile=True, compile_buckets="4",
                   async_scheduling=True)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got, want = run_both((compiled, eager(tiny)),
                         random_prompts(4, seed=41, lo=3, hi=10), params)
    assert got == want and compiled.engine.runner.steps["compiled"] > 0


FIRST_STEP_COMPILED = """
import json, torch
from minillm import LLM, SamplingParams
from minillm.models import load_model
tiny = load_model("tiny-llama", dtype=torch.float32)
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
c = LLM(tiny, engine="paged", compile=True, compile_buckets="1", linear_backend="gemv")
got = c.generate([[5]], params, progress=False)[0].token_ids
want = LLM(tiny, engine="paged", linear_backend="gemv").generate([[5]], params,
                                                                 progress=False)[0].token_ids
print(json.dumps({"got": got, "want": want, "compiled": c.engine.runner.steps["compiled"]}))
"""


@pytest.mark.slow
def test_a_process_whose_first_step_is_compiled_finds_the_gemv_operator():
    """A one-token prompt's first step is a decode-shaped step, so it runs compiled before any
    eager product has loaded the gemv extension (and with it the operator the graph calls): in a
    fresh process that was 'Could not run minillm::gemv'."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", FIRST_STEP_COMPILED], cwd=root,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["got"] == out["want"] and out["compiled"] == 4


@pytest.mark.slow
def test_a_server_s_engine_loop_compiles_every_reachable_bucket_before_it_serves(tiny):
    """``EngineLoop.start`` returns once the loop thread has warmed the engine up: every bucket
    the scheduler can fill (here 1 and 2 of 1,2,4: two sequences at most) is compiled before a
    request arrives, none after; the dummy rows' K/V in slot 0 change no token."""
    from minillm.serve.loop import EngineLoop

    lines: list[str] = []
    compiled = LLM(tiny, engine="paged", compile=True, compile_buckets="1,2,4", max_num_seqs=2)
    compiled.engine.runner.progress = lines.append
    loop = EngineLoop(compiled.engine).start()
    try:
        assert set(compiled.engine.runner.compile_s) == {1, 2}, lines
    finally:
        loop.shutdown()
    warmed = len(lines)
    twin = eager(tiny, max_num_seqs=2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = random_prompts(3, seed=5, lo=3, hi=9)
    # a warm-up graph a real step's guards refused would be compiled again, silently (the
    # server's was: its inputs had been one tensor twice); here it would be an error
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, want = run_both((compiled, twin), prompts, params)
    assert got == want
    assert compiled.engine.runner.steps["compiled"] > 0 and len(lines) == warmed, lines


def test_dynamo_s_recompile_limit_holds_on_every_thread_that_steps(tiny):
    """dynamo's settings are each thread's own: the limit the runner needs for its buckets (2
    more than dynamo's default of 8 here) is set on the thread that calls the graph, not only on
    the one that built the engine (a server's loop thread hit the default: an engine error)."""
    import threading
    compiled = LLM(tiny, engine="paged", compile=True,
                   compile_buckets=",".join(map(str, range(1, 11))))
    runner = compiled.engine.runner
    seen = []

    def step_there():
        runner.warm_up(1)
        seen.append(torch._dynamo.config.recompile_limit)

    worker = threading.Thread(target=step_there)
    worker.start()
    worker.join()
    assert seen == [12] and set(runner.compile_s) == {1}
