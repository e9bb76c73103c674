"""minillm's own forward (rung 3) equals the Hugging Face model's logits within fp32 rounding,
also when the prompt is split into chunks that read the cached prefix through block tables."""
from __future__ import annotations

import pytest
import torch

from conftest import random_prompts
from minillm.layers.attention.reference import TorchAttention
from minillm.core.block_manager import BlockManager
from minillm.layers.linear import get_linear_kernel, onednn_works
from minillm.core.runner import ModelRunner
from minillm.core.sequence import Sequence
from minillm.models import LoadedModel, ByteTokenizer
from minillm.request import Request, SamplingParams


def tiny_qwen2() -> LoadedModel:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.3, rope_theta=1e6)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():   # random, non-zero biases so the q/k/v bias path is really tested
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return LoadedModel("tiny-qwen2", model, ByteTokenizer(512), torch.float32, torch.device("cpu"))


def paged_logits(model: LoadedModel, prompt: list[int], chunks: list[int], block_size=4,
                 linear: str | None = None):
    """Run ``prompt`` through our forward in the given chunk sizes; logits of every position."""
    kernel = get_linear_kernel(linear, model.device, model.dtype)
    runner = ModelRunner(model, num_blocks=64, block_size=block_size, backend=TorchAttention(),
                         linear_kernel=kernel)
    assert runner.net.linear_kernel.name == kernel.name
    bm = BlockManager(64, block_size)
    seq = Sequence(Request(prompt, SamplingParams()), list(prompt), len(prompt))
    rows = []
    for n in chunks:
        bm.append_slots(seq, n)
        ids, pos, meta, _, _ = runner.prepare([(seq, n)])
        hidden = runner.net.forward(ids, pos, meta, runner.kv_caches, runner.backend)
        rows.append(runner.net.logits(hidden))
        seq.num_computed_tokens += n
    return torch.cat(rows)


@pytest.mark.parametrize("linear", ["torch", pytest.param("onednn", marks=pytest.mark.skipif(
    not onednn_works(), reason="no oneDNN in this torch build"))])
@pytest.mark.parametrize("which", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("chunks", [[37], [10, 1, 26], [1] * 37])
def test_forward_equals_hf(tiny, which, chunks, linear):
    model = tiny if which == "tiny-llama" else tiny_qwen2()
    if linear == "onednn" and model.device.type != "cpu":
        pytest.skip("oneDNN is the CPU's linear kernel")
    prompt = random_prompts(1, seed=3, lo=37, hi=37)[0]
    with torch.inference_mode():
        ref = model.hf_model(torch.tensor([prompt], device=model.device)).logits[0].float()
        got = paged_logits(model, prompt, chunks, linear=linear)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_smollm2_forward_equals_hf(smol):
    prompt = smol.tokenizer.encode("The paged KV cache stores keys and values in blocks, so")
    with torch.inference_mode():
        ref = smol.hf_model(torch.tensor([prompt], device=smol.device)).logits[0].float()
        got = paged_logits(smol, prompt, [len(prompt) - 3, 1, 2], block_size=16)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.slow      # reads the real SmolLM2 (the GGUF's conversion)
def test_converted_smollm2_is_a_plain_hf_directory(tmp_path):
    """Other tools (vLLM, transformers without gguf) load the converted directory: its config
    names no GGUF quantization, and a config that still does is repaired on the next load."""
    import json

    from minillm.models import ensure_smollm2_cache, plain_hf_dir
    cfg = json.loads((ensure_smollm2_cache() / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "gguf", "gguf_file": "x.gguf"}}))
    plain_hf_dir(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg


@pytest.mark.parametrize("value", ["", "  "])
def test_empty_minillm_cache_is_unset(monkeypatch, tmp_path, value):
    """Taken as a path, ``MINILLM_CACHE=`` would make the current folder the model cache (517 MB
    in the project). Empty or blank means unset: the home cache; a real value is taken as given."""
    from minillm.models import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MINILLM_CACHE", value)
    assert cache_dir() == tmp_path / ".cache" / "minillm"
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "models"))
    assert cache_dir() == tmp_path / "models"
