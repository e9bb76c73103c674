"""Rung 9: a narrower KV slot (layers/kv_quant.py). The formats' error bounds, the capacity the
engine really gets from them, and attention on a quantized pool -- the torch reference and the C++
kernel -- against dequantize-then-attend (the Triton kernels: test_kv_quant_triton.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtools import HEAD_DIM, NAN, SCALE, PagedKV, decode_lens, rel_err
from minillm import LLM, SamplingParams, load_model
from minillm.layers.attention.cpp import CppAttention, cpp_available
from minillm.layers.attention.reference import AttentionMetadata, TorchAttention
from minillm.layers.kv_quant import FORMATS, QuantizedPool, dequantize, get_format, quantize

NARROW = ("float16", "bfloat16", "int8", "fp8")


# --- the formats ---------------------------------------------------------------------------------
rows = st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=64)


@settings(max_examples=200, deadline=None)
@given(values=rows, zero=st.booleans())
def test_int8_error_is_at_most_half_a_step_and_the_largest_value_is_kept(values, zero):
    x = torch.tensor([[0.0] * len(values) if zero else values])
    q, scale = quantize(x, FORMATS["int8"])
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (1,)
    back = dequantize(q, scale, torch.float32)
    assert (back - x).abs().max() <= scale[0] * 0.5 * (1 + 1e-6)
    if x.abs().max() >= 127 * torch.finfo(torch.float32).tiny:   # not a subnormal row
        i = x.abs().argmax()
        assert abs(int(q.flatten()[i])) == 127        # the row's largest element sits on ±127


@settings(max_examples=200, deadline=None)
@given(values=rows)
def test_fp8_error_is_within_e4m3_rounding(values):
    """e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself, a subnormal
    one (below 2^-6 of the scale... of 448) by at most half its spacing, 2^-10 of the scale."""
    x = torch.tensor([values])
    q, scale = quantize(x, FORMATS["fp8"])
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize(q, scale, torch.float32)
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scale[0] * 2 ** -10 + 1e-30).all()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_formats_are_a_cast(name):
    x = torch.randn(5, 3, 8) * 30
    q, scale = quantize(x, FORMATS[name])
    assert scale is None and torch.equal(dequantize(q, None, torch.float32),
                                         x.to(FORMATS[name].storage).float())


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_is_what_a_write_then_a_read_give_back(name, dtype):
    """A fresh prompt's prefill attends to ``stored(rows)`` instead of reading its own rows back
    through the blocks (reference.py): the two must agree bit for bit."""
    torch.manual_seed(0)
    pool = QuantizedPool.zeros((6, 4, 3, HEAD_DIM), FORMATS[name], dtype, torch.device("cpu"))
    rows = (torch.randn(10, 3, HEAD_DIM) * torch.logspace(-3, 3, 10)[:, None, None]).to(dtype)
    slots = torch.randperm(24)[:10]
    pool.view(-1, 3, HEAD_DIM).index_copy_(0, slots, rows)
    back = pool.view(-1, 3, HEAD_DIM)[slots]
    assert back.dtype == dtype and torch.equal(pool.stored(rows), back)


def test_unknown_dtype_is_an_error_naming_it(tiny):
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4'"):
        LLM(tiny, engine="paged", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype 8"):
        get_format(8)


def test_int8_admits_over_3_5x_the_tokens_of_fp32_in_the_same_bytes(smol):
    """Block counts from the engine at one ``kv_cache_bytes``, and the bytes the pool's tensors
    really hold (scales included) against the engine's unit."""
    budget = 64 << 20
    blocks = {}
    for dtype in ("auto", *NARROW):
        llm = LLM(smol, engine="paged", kv_cache_bytes=budget, attention_backend="torch",
                  kv_cache_dtype=dtype)
        engine = llm.engine
        pool = engine.runner.pool
        blocks[dtype] = engine.block_manager.num_blocks
        assert pool.num_bytes == blocks[dtype] * engine.block_size * engine.kv_bytes_per_token
        assert pool.num_bytes <= budget < pool.num_bytes + engine.block_size * \
            engine.kv_bytes_per_token
        counts = engine.kv_counts()          # what tables, plots and /metrics read
        assert counts.total * counts.bytes_per_slot == pool.num_bytes
    print(blocks)
    assert blocks["int8"] >= 3.5 * blocks["auto"] and blocks["fp8"] == blocks["int8"]
    assert blocks["float16"] >= 1.99 * blocks["auto"]


# --- attention on a quantized pool -------------------------------------------------------------------
def quantized_pools(kv: PagedKV, name: str, dtype: torch.dtype, trap: bool):
    """kv's sequences written into two pools of format ``name`` through ``write_kv``; where no
    sequence lives, scales are NaN and data random when ``trap`` (a read there poisons the
    output), zero otherwise. Also returns the dequantized pools (zero where no sequence lives):
    what dequantize-then-attend reads."""
    fmt = FORMATS[name]
    pools = []
    for _ in range(2):
        pool = QuantizedPool.zeros(tuple(kv.k_ref.shape), fmt, dtype, torch.device("cpu"))
        if trap and pool.scale is not None:
            pool.scale.fill_(NAN)
            pool.data.copy_(torch.randint(-127, 128, pool.shape).to(fmt.storage))
        elif trap:
            pool.data.fill_(NAN)
        pools.append(pool)
    slots = torch.cat(kv.slots)
    TorchAttention.write_kv(torch.cat(kv.k_dense).to(dtype), torch.cat(kv.v_dense).to(dtype),
                            *pools, slots)
    dense = []
    for pool in pools:
        flat = torch.zeros(kv.k_ref.shape, dtype=dtype).view(-1, *kv.k_ref.shape[2:])
        flat[slots] = pool.view(-1, *kv.k_ref.shape[2:]).index_select(0, slots)
        dense.append(flat.view(kv.k_ref.shape))
    return pools, dense


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)])
def test_reference_decode_on_a_quantized_pool_equals_dequantize_then_attend(name, block_size,
                                                                           heads, kv_heads):
    torch.manual_seed(block_size * 7 + heads)
    kv = PagedKV(decode_lens(block_size), block_size, kv_heads)
    (kp, vp), (kd, vd) = quantized_pools(kv, name, torch.float32, trap=False)
    q = torch.randn(len(kv.lens), heads, HEAD_DIM)
    want = TorchAttention().decode(q, kd, vd, kv.tables, kv.context_lens, SCALE)
    got = TorchAttention().decode(q, kp, vp, kv.tables, kv.context_lens, SCALE)
    assert rel_err(got, want) <= 1e-6
    # and the format's error is what it is: small against attention on the exact K/V
    exact = TorchAttention().decode(q, kv.k_ref, kv.v_ref, kv.tables, kv.context_lens, SCALE)
    assert rel_err(got, exact) <= {"float16": 2e-3, "bfloat16": 2e-2, "int8": 3e-2,
                                   "fp8": 1e-1}[name]


@pytest.mark.skipif(not cpp_available(), reason="the C++ kernel cannot be built here")
@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("heads,kv_heads", [(3, 3), (6, 2), (9, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])
def test_cpp_decode_reads_a_quantized_pool_in_place(name, block_size, heads, kv_heads, dtype,
                                                    head_dim):
    """The kernel widens each stored row inside its loops (NaN-trapped pool: it must read exactly
    the rows the block tables list) and equals dequantize-then-attend: within 1e-5 relative in
    fp32; in fp64 within 1e-6 (the reference rounds each dequantized row through fp32, the
    kernel multiplies the scale in fp64). Head dim 64 is the vector path's (int8 there)."""
    torch.manual_seed(block_size + heads)
    kv = PagedKV(decode_lens(block_size), block_size, kv_heads, head_dim=head_dim)
    (kp, vp), (kd, vd) = quantized_pools(kv, name, dtype, trap=True)
    q = torch.randn(len(kv.lens), heads, head_dim, dtype=dtype)
    want = TorchAttention().decode(q, kd, vd, kv.tables, kv.context_lens, SCALE)
    got = CppAttention().decode(q, kp, vp, kv.tables, kv.context_lens, SCALE)
    assert got.dtype == dtype
    assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 1e-6)


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_extend_reads_every_row_through_the_pool(name, block_size):
    """Fresh prompts, prefix hits and chunks on a quantized pool: each chunk attends to the
    dequantized rows of its prefix *and of itself* (the same K/V whether a prompt is prefilled
    in one chunk or many)."""
    torch.manual_seed(block_size)
    bs = block_size
    case = [(0, 1), (0, bs + 2), (bs, 1), (3, bs + 1), (2 * bs + 1, 3)]
    kv = PagedKV([c + n for c, n in case], block_size, 2)
    (kp, vp), (kd, vd) = quantized_pools(kv, name, torch.float32, trap=False)
    q_lens = [n for _, n in case]
    q = torch.randn(sum(q_lens), 4, HEAD_DIM)
    new = lambda dense: torch.cat([dense[s][c:] for s, (c, _) in enumerate(case)])  # noqa: E731
    slots = torch.cat([kv.slots[s][c:] for s, (c, _) in enumerate(case)])
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode=0, decode_block_tables=torch.empty(0, 1, dtype=torch.int32),
        decode_context_lens=torch.empty(0, dtype=torch.int32), prefill_block_tables=kv.tables,
        prefill_cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
        prefill_context_lens=kv.context_lens, prefill_q_lens=q_lens, prefill_ctx_lens=kv.lens)
    k_deq = kd.view(-1, 2, HEAD_DIM)[slots]
    v_deq = vd.view(-1, 2, HEAD_DIM)[slots]
    want = TorchAttention().extend(q, k_deq, v_deq, kd, vd, meta, SCALE)
    got = TorchAttention().extend(q, new(kv.k_dense), new(kv.v_dense), kp, vp, meta, SCALE)
    assert rel_err(got, want) <= 1e-6


def test_copy_on_write_copies_scales_with_the_data(tiny):
    llm = LLM(tiny, engine="paged", block_size=4, num_blocks=8, kv_cache_dtype="int8",
              attention_backend="torch")
    pool = llm.engine.runner.pool
    for t in pool.tensors():
        t[2] = (torch.rand(t[2].shape) * 100).to(t.dtype)
    pool.copy_blocks([(2, 5)])
    for t in pool.tensors():
        assert torch.equal(t[5].view(torch.uint8) if t.element_size() == 1 else t[5],
                           t[2].view(torch.uint8) if t.element_size() == 1 else t[2])
    assert len(pool.tensors()) == 4 * tiny.config.num_hidden_layers   # data and scale, K and V


# --- the engine ---------------------------------------------------------------------------------
@pytest.mark.skipif(not cpp_available(), reason="the C++ kernel cannot be built here")
@pytest.mark.parametrize("name", ["int8", "fp8", "bfloat16"])
def test_cpp_and_torch_backends_give_the_same_tokens_on_a_narrow_cache(tiny, name):
    """In float64 (tiny64: no batch-shape flips) with greedy, sampled, n > 1 and beam requests."""
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
    params = [SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=8, beam_width=2, ignore_eos=True)]
    model64 = load_model("tiny-llama", dtype=torch.float64)
    outs = {}
    for backend in ("torch", "cpp"):
        llm = LLM(model64, engine="paged", block_size=4, num_blocks=96, kv_cache_dtype=name,
                  attention_backend=backend)
        outs[backend] = [o.samples for o in llm.generate(prompts, params, progress=False)]
        assert llm.engine.block_manager.num_free_blocks == 96
    assert outs["torch"] == outs["cpp"]


@pytest.fixture(scope="module")
def tiny64():
    return load_model("tiny-llama", dtype=torch.float64)


def _samples(llm, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, progress=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.samples for o in outs]


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_speculative_decoding_accepts_a_quantized_cache_unchanged(tiny64, speculative):
    """Greedy speculative decoding on an int8 cache gives the plain paged engine's tokens on the
    same cache (the draft stores its KV as the target does); a tight pool makes it truncate,
    copy and preempt."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(9, 40)), [3, 4] * 9]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    opts = dict(block_size=4, num_blocks=40, max_num_batched_tokens=16, kv_cache_dtype="int8")
    base = _samples(LLM(tiny64, engine="paged", **opts), prompts, params)
    llm = LLM(tiny64, engine="paged", speculative=speculative, num_speculative_tokens=3,
              draft_layers=1, **opts)
    assert _samples(llm, prompts, params) == base
    assert llm.engine.block_manager.num_free_blocks == 40
    if speculative == "draft":
        assert llm.engine.proposer.runner.pool.fmt.name == "int8"


def test_pipeline_stages_store_their_kv_in_the_chosen_format(tiny64):
    if tiny64.device.type == "cuda":
        pytest.skip("on GPUs pipeline stages are one process per GPU (torchrun), not spawned")
    from minillm.engines.r7_pipeline.engine import PipelineEngine
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 30)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=8, n=2, temperature=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=8, beam_width=2, ignore_eos=True)]
    opts = dict(block_size=4, num_blocks=48, max_num_batched_tokens=16, kv_cache_dtype="fp8")
    base = _samples(LLM(tiny64, engine="paged", **opts), prompts, params)
    engine = PipelineEngine(tiny64, pipeline_parallel_size=2, num_microbatches=2, **opts)
    try:
        reqs = LLM(tiny64, engine="naive").make_requests(prompts, params)
        assert [o.samples for o in engine.run(reqs).outputs] == base
        assert engine.runner.pool.fmt.name == "fp8"
    finally:
        engine.close()


def test_server_serves_an_int8_cache_and_counts_its_real_bytes(tiny):
    """The same completion as offline on the same cache; /metrics and the dashboard's frame
    report the pool's bytes as it stores them (scales included), not the model's dtype's."""
    import httpx
    import openai
    from serve_util import running_server

    opts = dict(engine="paged", num_blocks=64, block_size=4, kv_cache_dtype="int8")
    want = LLM(tiny, **opts).generate(["count to ten"], SamplingParams(max_tokens=8),
                                      progress=False)[0].text
    llm = LLM(tiny, **opts)
    with running_server(llm) as (url, app):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        got = client.completions.create(model="tiny-llama", prompt="count to ten", max_tokens=8,
                                        temperature=0).choices[0].text
        metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                   for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
                   if line.startswith("minillm:kv_cache")}
        frame = app.state.dashboard.frame
    assert got == want
    engine = llm.engine
    assert metrics["minillm:kv_cache_bytes_per_token"] == engine.kv_bytes_per_token \
        < tiny.kv_bytes_per_token
    assert metrics["minillm:kv_cache_bytes"] == engine.runner.pool.num_bytes
    assert frame["kv_cache_dtype"] == "int8"
    assert frame["kv"]["bytes_per_slot"] == engine.kv_bytes_per_token


# --- accuracy, on the real model ------------------------------------------------------------------
@pytest.mark.parametrize("name,tie_tol", [("float16", 1e-3), ("bfloat16", 2e-2)])
def test_16_bit_cache_gives_hf_greedy_tokens_within_the_near_tie_rule(smol, name, tie_tol,
                                                                      hf_ref):
    """A 16-bit cache is a cast: fp16 keeps 11 significant bits and flips no more than fp32's
    batch shapes do (the usual 1e-3 rule); bf16 keeps 8, its K/V are off by up to 2^-9 relative,
    which moves logits by up to ~1e-2 here (measured on 32 chat prompts x 64 tokens: 3 flips
    beyond fp32's, at HF margins 0.002-0.018) -- so its near-tie is 2e-2."""
    from minillm.lab.reference import assert_greedy_match
    from minillm.workload import load_prompts

    llm = LLM(smol, engine="paged", kv_cache_dtype=name)
    ids = [llm.encode({"messages": p["messages"]}) for p in load_prompts()[:8]]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(max_tokens=32, temperature=0), progress=False)
    for i, (prompt, out) in enumerate(zip(ids, outs)):
        assert_greedy_match(out.token_ids, hf_ref(smol, prompt, 32, stop_at_eos=True),
                            tie_tol=tie_tol, label=f"{name} prompt {i}")


def test_int8_and_fp8_accuracy_is_within_what_was_measured(smol):
    """``kv_accuracy.measure`` as docs/rungs/09_quantized_kv.md runs it (64 greedy tokens, the
    shipped passage), on the first 16 of its 32 bundled chat prompts. Measured on this CPU
    (python -m minillm.bench.kv_accuracy): int8 47% of the 32 outputs identical to fp32's (62% of
    these 16), KL 5.3e-4, perplexity 36.04 vs 36.01; fp8 22% (31%), KL 3.0e-3, 36.38 (KL and
    perplexity come from the passage: the same on 16 prompts). The bounds leave room for another
    CPU's rounding, and fail if a format gets markedly worse (a wrong scale, a read of the wrong
    rows: KL jumps by orders)."""
    from minillm.bench.kv_accuracy import measure

    rows = {r["kv_cache_dtype"]: r for r in measure(smol, ("int8", "fp8"), num_prompts=16,
                                                     progress=None)}
    ppl = rows["auto"]["perplexity"]
    assert rows["auto"]["identical_share"] == 1 and rows["auto"]["kl_mean"] == 0
    assert rows["int8"]["identical_share"] >= 0.35 and rows["int8"]["kl_mean"] < 2e-3
    assert rows["int8"]["perplexity"] < ppl * 1.005
    assert rows["fp8"]["identical_share"] >= 0.12 and rows["fp8"]["kl_mean"] < 1e-2
    assert rows["fp8"]["perplexity"] < ppl * 1.03
    assert rows["int8"]["kl_mean"] < rows["fp8"]["kl_mean"]   # 7 bits beat e4m3's 3 + exponent


def test_accuracy_over_the_passage_s_first_tokens(tiny):
    """``passage_tokens`` (notebook 09's quick run): KL and perplexity over that many tokens of
    the passage, equal to measuring with the passage cut there; a count that predicts nothing is
    an error naming the parameter."""
    from minillm.bench.kv_accuracy import PASSAGE, kl_and_perplexity, measure, passage_logprobs

    rows = measure(tiny, ("int8",), num_prompts=1, max_tokens=2, progress=None,
                   passage_tokens=24)
    assert [r["passage_tokens"] for r in rows] == [24, 24]
    ids = tiny.tokenizer.encode(PASSAGE.read_text(encoding="utf-8"))[:24]
    ref, got = passage_logprobs(tiny, ids, "auto"), passage_logprobs(tiny, ids, "int8")
    assert (rows[1]["kl_mean"], rows[1]["perplexity"]) == kl_and_perplexity(ref, got, ids)
    for bad in (1, 0, True, "24", 2.5):
        with pytest.raises(ValueError, match=r"passage_tokens must be an int >= 2.*got"):
            measure(tiny, ("int8",), num_prompts=1, max_tokens=2, progress=None,
                    passage_tokens=bad)
