"""lm-evaluation-harness against ``minillm serve``, beside lm-eval's own Hugging Face backend on
the same tasks, the server checked from outside (the serving rung, docs/SERVING.md):
``python -m minillm.bench.lm_eval``, ``make eval``.

Two small tasks ship with the package (``minillm/data/lm_eval/``: a JSONL and a task YAML each,
so nothing comes from a hub): ``minillm_facts_mc``, multiple choice scored by log-likelihood,
which lm-eval's ``local-completions`` asks as ``echo`` + ``logprobs`` + ``max_tokens: 1`` over
the context's and the choice's token ids; and ``minillm_arith_gen``, greedy answers through
the chat template (``local-chat-completions``), the last number compared with the expected one.

lm-eval pins its own dependencies, so it never goes into the project's environment:
``ensure_venv`` makes ``.venv-lmeval`` beside it (once), as ``vllm_peer`` does for vLLM. The
script starts ``python -m minillm serve`` (SmolLM2, fp32) on a free port, runs lm-eval on both
tasks, stops the server, then runs lm-eval again on the same tasks with ``--model hf`` (the same
SmolLM2 as a plain Hugging Face directory, fp32 on the CPU, the same torch thread count as the
server's, ``--apply_chat_template`` for the generation task as ``local-chat-completions``
implies), and compares the two runs' samples item by item (``lm_eval_compare``): the
per-choice log-likelihoods, the greedy flags, the generated texts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from .lm_eval_compare import compare, print_table, read_output

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-lmeval"
LM_EVAL = "lm-eval[api]==0.4.13"      # pinned: its request shapes are what this file mirrors
TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
MC_TASK, GEN_TASK = "minillm_facts_mc", "minillm_arith_gen"
MODEL = "smollm2-135m-instruct"
CHAT = "--apply_chat_template"      # the generation task's, on both sides


# --- the tasks, as the YAML files describe them ----------------------------------------------------
def task_config(task: str) -> dict:
    import yaml

    return yaml.safe_load((TASK_DIR / f"{task}.yaml").read_text())


def task_docs(task: str) -> list[dict]:
    """The documents of ``task``: its JSONL's lines (the YAML's ``data_files`` test split)."""
    path = TASK_DIR / task_config(task)["dataset_kwargs"]["data_files"]["test"]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def render(template: str, doc: dict) -> str:
    """A YAML ``doc_to_text`` for one document (Jinja2, as lm-eval renders it)."""
    from jinja2 import Template

    return Template(template).render(**doc)


def last_number(text: str) -> str:
    """The generation task's filter (its YAML's ``regex`` with ``group_select: -1``)."""
    found = re.findall(r"(-?[0-9]+)", text)
    return found[-1].strip() if found else "[invalid]"


# --- lm-eval in its own environment ----------------------------------------------------------------
def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def torch_requirement() -> str:
    """The project's torch as a pip requirement: ``torch==2.13.0`` for a running ``2.13.0+cpu``.
    Without the local label it matches every build of that version, and pip takes the one its
    index offers (on the lab machines the CPU wheel on disk, as ``make setup``'s ``TORCH``)."""
    import torch

    return "torch==" + torch.__version__.split("+")[0]


def ensure_venv() -> Path:
    """``.venv-lmeval`` with lm-eval's API extra, transformers (the tokenizer ``local-completions``
    counts context tokens with), and torch + accelerate: lm-eval's ``--model hf`` backend imports
    both. torch is the project's own version, so that the HF side computes with the same kernels
    as the server does (and pip keeps the CPU build the index has). Made once."""
    py = venv_python()
    if py.exists() and subprocess.run([str(py), "-c", "import lm_eval, transformers, torch, "
                                       "accelerate"], capture_output=True).returncode == 0:
        return py
    print(f"[minillm] installing {LM_EVAL} and {torch_requirement()} into {VENV} (once, ~3 min)",
          flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", LM_EVAL, "transformers",
                    torch_requirement(), "accelerate"], check=True)
    return py


def engine_threads() -> int:
    """The torch threads ``minillm serve`` computes on by default (``serve/cli.py``): given to the
    server explicitly and to the HF side's process (``OMP_NUM_THREADS``), so both use as many."""
    import torch

    return max(1, min(torch.get_num_threads(), 8))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(log_path: Path, timeout_s: float, extra: list[str]):
    """``python -m minillm serve`` (SmolLM2, fp32) on a free port: yields its base URL once
    ``/health`` answers; the server is stopped on every way out (SIGTERM, then SIGKILL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", MODEL, "--dtype", "float32",
           "--port", str(port), "--no-dashboard", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text()[-3000:]      # the log goes with its temporary dir
                why = (f"exit status {proc.returncode}" if proc.poll() is not None
                       else f"no /health in {timeout_s:.0f} s")
                raise RuntimeError(f"the server did not start ({why}):\n{tail}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def run_lm_eval(py: Path, model: str, args: str, task: str, out: Path, limit: int | None,
                timeout_s: float, flags: list[str], env: dict | None = None
                ) -> tuple[dict, list[dict]]:
    """One lm-eval run of ``task`` (offline: the data is local), one request or sequence at a
    time on both sides (``--batch_size 1``; the served side keeps ``num_concurrent`` in flight,
    which the server batches); its results and its samples."""
    cmd = [str(py), "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", task,
           "--include_path", str(TASK_DIR), "--batch_size", "1", "--log_samples",
           "--output_path", str(out)]
    cmd += flags
    cmd += ["--limit", str(limit)] if limit else []
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "",
           **(env or {})}
    print(f"[minillm] lm_eval --model {model} --tasks {task}", end="", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    print(f": {time.perf_counter() - t0:.0f} s", flush=True)
    if done.returncode:
        raise RuntimeError(f"lm_eval failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return read_output(out, task)


def served_runs(py: Path, tokenizer_dir: Path, limit: int | None, concurrent: int,
                threads: int, timeout_s: float, work: Path) -> dict:
    """Both tasks through ``minillm serve``: log-likelihood over ``/v1/completions`` (token ids,
    counted with the model's own tokenizer), generation over ``/v1/chat/completions``."""
    with served(work / "server.log", timeout_s, ["--threads", str(threads)]) as url:
        common = f"model={MODEL},num_concurrent={concurrent},max_retries=1,timeout={int(timeout_s)}"
        mc = run_lm_eval(py, "local-completions",
                         f"{common},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                         f"tokenizer={tokenizer_dir}", MC_TASK, work / "mc", limit, timeout_s, [])
        gen = run_lm_eval(py, "local-chat-completions",
                          f"{common},base_url={url}/v1/chat/completions", GEN_TASK, work / "gen",
                          limit, timeout_s, [CHAT])
    return {MC_TASK: mc, GEN_TASK: gen}


def hf_model_args(model_dir: Path) -> str:
    """lm-eval's ``--model hf`` on the same weights as the server's, in fp32 (and ``--device
    cpu``: lm-eval passes its ``--device`` to the model too, so it cannot go in here)."""
    return f"pretrained={model_dir},dtype=float32"


def hf_runs(py: Path, model_dir: Path, limit: int | None, threads: int, timeout_s: float,
            work: Path) -> dict:
    """Both tasks through lm-eval's Hugging Face backend (transformers in ``.venv-lmeval``, its
    process on the server's thread count); the generation task through the chat template, as
    ``local-chat-completions`` sends a chat (the task YAML's greedy kwargs go to both)."""
    env, cpu = {"OMP_NUM_THREADS": str(threads)}, ["--device", "cpu"]
    mc = run_lm_eval(py, "hf", hf_model_args(model_dir), MC_TASK, work / "hf-mc", limit,
                     timeout_s, cpu, env)
    gen = run_lm_eval(py, "hf", hf_model_args(model_dir), GEN_TASK, work / "hf-gen", limit,
                      timeout_s, [*cpu, CHAT], env)
    return {MC_TASK: mc, GEN_TASK: gen}


def stop_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.bench.lm_eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="only the first N documents per task")
    ap.add_argument("--num-concurrent", type=int, default=4,
                    help="requests lm-eval keeps in flight (the server batches them)")
    ap.add_argument("--timeout-s", type=float, default=900.0,
                    help="bound on the server's start and on each lm-eval run")
    ap.add_argument("--json", default=str(ROOT / "figures" / "lm_eval.json"))
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be at least 1 (got {args.limit})")
    from ..models import ensure_smollm2_cache

    # SIGTERM/SIGHUP exit through the ``finally``s, as Ctrl-C does: the server and lm-eval are
    # stopped, not orphaned (the default handlers end the process on the spot)
    for sig in {signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)}:
        signal.signal(sig, stop_on_signal)
    model_dir = ensure_smollm2_cache()
    py = ensure_venv()
    threads = engine_threads()
    limit_arg = f" --limit {args.limit}" if args.limit else ""
    with tempfile.TemporaryDirectory(prefix="minillm-lmeval-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        ours = served_runs(py, model_dir, args.limit, args.num_concurrent, threads,
                           args.timeout_s, work)
        t1 = time.perf_counter()             # the server has stopped: the cores are free
        ref = hf_runs(py, model_dir, args.limit, threads, args.timeout_s, work)
        t2 = time.perf_counter()
    tasks = {MC_TASK: "multiple_choice", GEN_TASK: "generate_until"}
    report = {**compare(ours, ref, tasks), "model": MODEL, "dtype": "float32",
              "limit": args.limit, "lm_eval": LM_EVAL, "torch_threads": threads,
              "served_s": round(t1 - t0, 1), "hf_s": round(t2 - t1, 1),
              "hf_model_args": hf_model_args(Path("<SmolLM2 HF dir>")) + " --device cpu",
              "command": "python -m minillm.bench.lm_eval" + limit_arg}
    print_table(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
