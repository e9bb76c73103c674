"""The model's dtype: ``--dtype auto`` is bf16 exactly where the device computes it
natively (ISA detection, never a timed trial), every engine runs a bf16 model, and our bf16
forward is as close to fp32 as Hugging Face's own bf16 forward is."""
from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams, load_model
from minillm import models
from minillm.bench.kv_accuracy import kl_and_perplexity, passage_logprobs

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_bf16():
    return load_model("tiny-llama", dtype=torch.bfloat16)


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_isa_and_says_when_it_falls_back(monkeypatch, capsys, native):
    monkeypatch.setattr(models, "native_bf16", lambda device_type="cpu": native)
    models.say_once.cache_clear()
    assert models.resolve_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
    assert models.resolve_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
    err = capsys.readouterr().err
    if native:
        assert err == ""
    else:   # one line, once, naming what is missing
        assert err.count("\n") == 1 and "no native bf16" in err and "float32" in err


def test_native_bf16_reads_the_isa():
    """What torch reads from CPUID: AMX tiles or AVX512-BF16 (``lscpu``'s amx_bf16 /
    avx512_bf16); never a timing."""
    expected = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert models.native_bf16("cpu") == expected
    assert not models.native_bf16("mps")


def test_dtype_names_and_errors(tiny):
    assert models.resolve_dtype(None, CPU) == torch.float32      # the library's default
    assert models.resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert models.resolve_dtype(torch.float16, CPU) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'bf16': choose one of auto, float32"):
        models.resolve_dtype("bf16", CPU)
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        LLM("tiny-llama", dtype="half")
    with pytest.raises(ValueError, match="dtype 'bfloat16' asked for a model loaded in "
                                         "torch.float32"):
        LLM(tiny, dtype="bfloat16")
    with pytest.raises(ValueError, match="threads must be an integer >= 1, got 0"):
        LLM(tiny, threads=0)
    assert LLM("tiny-llama", dtype="bfloat16", engine="naive").model.dtype == torch.bfloat16


@pytest.mark.parametrize("engine,options", [
    ("naive", {}), ("static", {}), ("dynamic", {}), ("paged", {}),
    ("paged", {"attention_backend": "torch"}), ("paged", {"kv_cache_dtype": "int8"}),
    ("paged", {"speculative": "ngram"})])
def test_every_engine_runs_a_bf16_model(tiny_bf16, engine, options):
    """Every rung on one process takes a bf16 model: n > 1 and beams where the engine has them,
    each request finishing with its tokens (their closeness to fp32 is the next test's)."""
    llm = LLM(tiny_bf16, engine=engine, **options)
    params = [SamplingParams(max_tokens=6, ignore_eos=True)]
    if llm.engine.supports_parallel:
        params += [SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=1, ignore_eos=True),
                   SamplingParams(max_tokens=6, beam_width=2, ignore_eos=True)]
    outs = llm.generate([[5, 6, 7, 8]] * len(params), params)
    assert all(o.error is None and len(o.token_ids) == 6 for o in outs)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.hf_model(torch.tensor([ids], device=model.device)).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("name", ["tiny-llama", pytest.param("smollm2-135m-instruct",
                                                              marks=pytest.mark.slow)])
def test_bf16_forward_is_as_close_to_fp32_as_hugging_faces(name):
    """Our bf16 forward (oneDNN bf16 GEMMs, fp32 norms and softmax, fp32 logits) differs from
    the fp32 reference by no more than Hugging Face's bf16 forward does (KL over a passage)."""
    fp32, bf16 = load_model(name, dtype=torch.float32), load_model(name, dtype=torch.bfloat16)
    ids = fp32.tokenizer.encode("The paged KV cache stores keys and values in fixed-size "
                                "blocks, so memory is allocated as sequences grow. " * 3)
    ref = hf_logprobs(fp32, ids)
    ours_kl, _ = kl_and_perplexity(ref, passage_logprobs(bf16, ids, "auto"), ids)
    hf_kl, _ = kl_and_perplexity(ref, hf_logprobs(bf16, ids), ids)
    ours_fp32_kl, _ = kl_and_perplexity(ref, passage_logprobs(fp32, ids, "auto"), ids)
    assert ours_fp32_kl < 1e-6 < hf_kl                   # fp32 is the reference; bf16 is not
    assert ours_kl <= 2 * hf_kl + 1e-5, (ours_kl, hf_kl)


def test_dtype_accuracy_report(capsys):
    from minillm.bench import dtype_accuracy

    assert dtype_accuracy.main(["--model", "tiny-llama", "--prompts", "3",
                                "--max-tokens", "5"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["float32", "bfloat16"]
    assert rows[0][2] == "100.0%" and float(rows[0][7]) == 0.0      # the reference itself
    assert float(rows[1][7]) > 0 and float(rows[1][9]) > 1            # KL, perplexity
