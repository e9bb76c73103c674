"""Rung 13: many LoRA adapters in one batch equal Hugging Face's model with each adapter merged
into its weights (``W + scale * B A``), token for token (tiny model, fp32)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import assert_greedy_match, hf_greedy, random_prompts
from minillm import LLM, LoRARequest, SamplingParams
from minillm.engines.r13_lora.config import LoRAConfig
from minillm.engines.r13_lora.kernels import bgmv, delta_reference, sgmv
from minillm.engines.r13_lora.peft_files import (merged_model, read_adapter, save_peft_adapter,
                                                 save_random_adapter)
from minillm.engines.r13_lora.slots import LoRASlots

# name -> (rank, targets, use_rslora): different ranks, modules and scalings
ADAPTERS = {"qv": (2, ("q_proj", "v_proj"), False),
            "mlp": (8, ("gate_proj", "up_proj", "down_proj"), False),
            "all": (4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"), True)}
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """name -> (LoRARequest, the merged reference model)."""
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for seed, (name, (r, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = save_random_adapter(root / name, tiny.hf_model, r=r, lora_alpha=2 * r,
                                   targets=targets, use_rslora=rslora, seed=seed)
        lora = LoRARequest(name, str(path))
        merged = merged_model(tiny.hf_model, read_adapter(lora, tiny.hf_model))
        out[name] = (lora, dataclasses.replace(tiny, hf_model=merged))
    return out


def check_against_hf(tiny, adapters, prompts, names, outs, max_tokens=10):
    for prompt, name, out in zip(prompts, names, outs):
        assert out.error is None, out.error
        model = tiny if name is None else adapters[name][1]
        assert_greedy_match(out.token_ids, hf_greedy(model, prompt, max_tokens), label=str(name))


def lora_llm(tiny, **options) -> LLM:
    return LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=8, **options)


@pytest.mark.parametrize("kernel", ["sgmv", "bgmv"])
def test_mixed_batch_with_fewer_slots_equals_merged_hf(tiny, adapters, kernel):
    """Base + 3 adapters (ranks 2, 8, 4; attention, MLP, all; one rsLoRA) in one run with 2 slots:
    every request equals HF on its merged model, adapters were swapped, none failed, pool full."""
    names = [None, "qv", "mlp", "all"] * 2
    prompts = random_prompts(len(names), seed=3, hi=30)
    llm = lora_llm(tiny, max_loras=2, lora_kernel=kernel)
    loras = [None if n is None else adapters[n][0] for n in names]
    outs = llm.generate(prompts, GREEDY, lora_request=loras)
    check_against_hf(tiny, adapters, prompts, names, outs)
    engine = llm.engine
    assert engine.runner.slots.evictions > 0          # 3 adapters, 2 slots: swapped
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_mixed_batch_equals_each_alone(tiny, adapters):
    names = ["all", None, "qv", "mlp", "qv"]
    prompts = random_prompts(len(names), seed=4, hi=20)
    loras = [None if n is None else adapters[n][0] for n in names]
    llm = lora_llm(tiny, max_loras=3)
    together = llm.generate(prompts, GREEDY, lora_request=loras)
    alone = [llm.generate([p], GREEDY, lora_request=[lo])[0] for p, lo in zip(prompts, loras)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    base = llm.generate(prompts, GREEDY)                  # and each adapter changes the tokens
    assert [t.token_ids != b.token_ids for t, b in zip(together, base)] == \
        [n is not None for n in names]


def test_preemption_and_one_slot(tiny, adapters):
    """A pool so small that requests are preempted, one slot for three adapters: still exact."""
    names = ["qv", "mlp", None, "all", "mlp", "qv"]
    prompts = random_prompts(len(names), seed=5, lo=10, hi=30)
    llm = lora_llm(tiny, max_loras=1, num_blocks=7, block_size=8)
    loras = [None if n is None else adapters[n][0] for n in names]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True),
                        lora_request=loras)
    check_against_hf(tiny, adapters, prompts, names, outs, max_tokens=16)
    assert llm.engine.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_keyed_by_adapter(tiny, adapters):
    """The same prompt under another adapter never reuses the first one's blocks; under the same
    adapter it does; the tokens stay HF's."""
    prompt = random_prompts(1, seed=6, lo=20, hi=20)[0]
    llm = lora_llm(tiny, max_loras=2, enable_prefix_caching=True, block_size=4)
    runs = [("qv", 0), ("mlp", 0), (None, 0), ("qv", 16), (None, 16)]   # (adapter, hit tokens)
    for name, hits in runs:
        before = llm.engine.prefix_hit_tokens
        lora = None if name is None else adapters[name][0]
        out = llm.generate([prompt], GREEDY, lora_request=lora)
        check_against_hf(tiny, adapters, [prompt], [name], out)
        assert llm.engine.prefix_hit_tokens - before == hits, name


def test_samples_and_beams_with_an_adapter(tiny, adapters):
    """n > 1 seeded sampling and beam search under an adapter equal the plain engine on the
    merged model."""
    lora, merged = adapters["all"]
    prompts = random_prompts(2, seed=7, hi=15)
    params = [SamplingParams(max_tokens=8, n=3, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=8, beam_width=3, ignore_eos=True)]
    got = lora_llm(tiny, max_loras=1).generate(prompts, params, lora_request=lora)
    want = LLM(merged, engine="paged").generate(prompts, params)
    assert [o.samples for o in got] == [o.samples for o in want]


def test_kernels_agree_with_row_by_row():
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(4, 6, 10, generator=g), torch.randn(4, 7, 6, generator=g)
    A[0], B[0] = 0, 0
    x, idx = torch.randn(9, 10, generator=g), torch.tensor([0, 2, 1, 2, 3, 0, 1, 1, 3])
    want = delta_reference(x, A, B, idx)
    rows = (idx != 0).nonzero().flatten()
    segments = [(s, (idx == s).nonzero().flatten()) for s in (1, 2, 3)]
    torch.testing.assert_close(sgmv(torch.zeros(9, 7), x, A, B, segments), want)
    torch.testing.assert_close(bgmv(torch.zeros(9, 7), x, A, B, rows, idx[rows]), want)


def test_slots_lru_never_evicts_a_busy_adapter(tiny, adapters):
    shapes = {m: (4, 4) for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                  "up_proj", "down_proj")}
    slots = LoRASlots(shapes, 1, 2, 2, "cpu", torch.float32)

    def fake(name):
        return read_adapter_stub(name)
    a, b, c = fake("a"), fake("b"), fake("c")
    assert slots.acquire(a, set()) == 1 and slots.acquire(b, set()) == 2
    assert slots.acquire(c, {"a", "b"}) is None           # both in use: c waits
    assert slots.acquire(a, set()) == 1                   # a is now the most recently used
    assert slots.acquire(c, {"a"}) == 2                   # b, least recent and idle, goes
    assert slots.table() == [(1, "a"), (2, "c")] and slots.evictions == 1
    assert slots.A[0, "q_proj"].shape[0] == 2                # slot 0 (base) stores nothing
    torch.testing.assert_close(slots.B[0, "q_proj"][1, :, :1], torch.ones(4, 1))   # slot 2 = c


def read_adapter_stub(name):
    from minillm.engines.r13_lora.adapter import LoRAAdapter
    return LoRAAdapter(name, 1, 1.0, {(0, "q_proj"): (torch.ones(1, 4), torch.ones(4, 1))})


@pytest.mark.parametrize("field,value", [
    ("bias", "all"), ("use_dora", True), ("modules_to_save", ["lm_head"]),
    ("layers_to_transform", [0]), ("rank_pattern", {"q_proj": 2}), ("fan_in_fan_out", True),
    ("peft_type", "IA3"), ("target_modules", ["embed_tokens"]), ("r", 64)])
def test_unsupported_adapter_fields_are_named(tiny, tmp_path, field, value):
    path = save_random_adapter(tmp_path / "bad", tiny.hf_model, r=2, **{field: value}) \
        if field != "r" else _with_config(tiny, tmp_path, r=64)
    llm = lora_llm(tiny)
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("bad", str(path)))


def _with_config(tiny, tmp_path, **fields):
    path = save_random_adapter(tmp_path / "bad", tiny.hf_model, r=2)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return path


def test_bad_tensors_and_requests_are_refused(tiny, adapters, tmp_path):
    weights = {(0, "q_proj"): (torch.zeros(2, 65), torch.zeros(64, 2))}
    llm = lora_llm(tiny)
    with pytest.raises(ValueError, match="lora_A"):          # wrong shape for this model
        bad = save_peft_adapter(tmp_path / "shape", weights, 2, 4)
        llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("shape", str(bad)))
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("none", str(tmp_path)))
    lora = adapters["qv"][0]
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(tiny, engine="paged").generate([[5, 6]], GREEDY, lora_request=lora)
    with pytest.raises(ValueError, match="enable_lora"):     # rung 6 takes no adapters
        LLM(tiny, engine="paged", speculative="ngram", enable_lora=True)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        llm.generate([[5], [6]], GREEDY, lora_request=[lora])
    llm.engine.add_lora(lora)
    with pytest.raises(ValueError, match="already"):
        llm.generate([[5]], GREEDY, lora_request=LoRARequest("qv", str(tmp_path)))
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("x", 1)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_adapters_compose_with_a_quantized_kv_cache(tiny, adapters, kv):
    """Rung 9's narrow KV slots under rung 13: an adapter's requests equal the paged engine on
    the merged model with the same KV format (the deltas reach K and V before they are stored)."""
    prompts, params = random_prompts(4, seed=11), SamplingParams(max_tokens=10, ignore_eos=True)
    lora, merged = adapters["all"]
    mine = lora_llm(tiny, kv_cache_dtype=kv).generate(prompts, params, lora_request=lora)
    ref = LLM(merged, engine="paged", kv_cache_dtype=kv).generate(prompts, params)
    assert [o.token_ids for o in mine] == [o.token_ids for o in ref]


def test_adapters_run_on_a_bf16_model(tiny, adapters):
    """bf16 weights and activations (the dtype people serve in): adapters load in the model's
    dtype, every request ends, and the adapter changes the tokens."""
    from minillm import load_model
    llm = lora_llm(load_model("tiny-llama", dtype=torch.bfloat16))
    prompts, params = random_prompts(4, seed=12), SamplingParams(max_tokens=8, ignore_eos=True)
    with_lora = llm.generate(prompts, params, lora_request=adapters["all"][0])
    base = llm.generate(prompts, params)
    assert all(o.error is None and len(o.token_ids) == 8 for o in with_lora + base)
    assert [o.token_ids for o in with_lora] != [o.token_ids for o in base]
