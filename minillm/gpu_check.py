"""One command for a session lent a GPU: ``python -m minillm.gpu_check --out DIR``.

A GPU machine is lent by chance and for minutes (``../shared/GPU.md``), so everything worth
knowing there runs from one call and prints one table:

1. ``tests``: the device-independent tests (engines, sampling, recovery, soak, speculative, the
   Triton kernels natively, quantized KV, LoRA, rung 12) on ``cuda`` -- every failure is a bug the
   CPU's CI cannot see;
2. ``kernels``: ``minillm.bench.kernels --quick``, each Triton kernel's bandwidth against a copy;
3. ``engines``: the ladder end to end on a model with SmolLM2-135M's shapes and random weights
   (``smollm2-random``: its weights cannot travel; the shapes set the speed) in bf16 -- naive,
   static, dynamic, paged (Triton attention), paged-async and Hugging Face's two batched peers on
   the same requests (``python -m minillm bench``);
4. ``profile``: where a decode step's time goes on the GPU -- the step's wall time against the
   time the device spent in kernels (``torch.profiler``), at 1, 32 and 128 running sequences;
5. what three features change on a GPU: ``rung12`` (``minillm.bench.async_step``: the step
   with and without ``async_scheduling``, and the host time the overlap hid), ``lora``
   (``minillm.bench.lora`` with each adapter kernel, Triton's natively) and ``structured``
   (``minillm.bench.structured_mask``: a JSON schema's mask per step at 64 rows).

Each part runs in its own process under its own time budget, so one that hangs or crashes still
leaves the others' numbers; logs and JSON land in ``--out``. Without CUDA it refuses unless
``--allow-cpu`` (a dry run of the plumbing: ``--model tiny-llama --budgets none``: the budgets
are sized for a GPU's minutes, and a CPU on a busy machine may need longer for the same part).
Results from an H200 are in docs/RESULTS.md, "On a lent GPU".

The lent machine has torch, triton, transformers, pytest and hypothesis but not the server's
packages: carry their wheels (the device tool's README says how) for the tests that start a
server -- fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-inspection,
opentelemetry-api, uvicorn, openai, httpx2, httpcore2, truststore, jiter, sniffio, distro --
and xgrammar, apache-tvm-ffi and jsonschema (+ its dependencies) for structured output.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tests", "kernels", "engines", "profile", "rung12", "lora", "structured")
TEST_FILES = ("core/test_engines", "runtime/test_sampling", "core/test_recovery",
              "core/test_soak", "rungs/test_r06_speculative", "rungs/test_r06_speculative_rules",
              "layers/test_triton_kernels", "layers/test_kv_quant_triton",
              "rungs/test_r13_lora_triton", "rungs/test_r13_lora",
              "rungs/test_r12_async_scheduling", "rungs/test_r12_batch_controller",
              "core/test_block_manager", "core/test_kv_pool", "rungs/test_r09_kv_quant",
              "rungs/test_r08_policy", "rungs/test_r12_slo_policy", "runtime/test_dtype",
              "layers/test_fused_ops", "core/test_model", "runtime/test_logprobs",
              "runtime/test_sampler_controls", "runtime/test_structured_output",
              "serve/test_serve_grammar", "rungs/test_r13_lora_hostile")
ENGINES = "naive,static,dynamic,paged,paged-async,hf-static,hf-generate-batch"
PROFILE_ROWS = (1, 32, 128)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
# Seconds per part on a lent GPU (PARTS' order): together under the session's 15 minutes.
BUDGETS = "200,90,150,60,90,120,40"


def parse_budgets(text: str) -> dict[str, float | None]:
    """``--budgets``: seconds per part in PARTS' order, or ``none`` (one for all, or per part):
    no limit. 0 is no limit too."""
    items = [b.strip() for b in text.split(",")]
    if len(items) == 1 and items[0].lower() == "none":
        items = items * len(PARTS)
    if len(items) != len(PARTS):
        raise ValueError(f"--budgets={text!r}: give {len(PARTS)} values ({', '.join(PARTS)}) "
                         "or 'none'")
    budgets = {}
    for name, item in zip(PARTS, items):
        try:
            value = None if item.lower() == "none" else float(item)
        except ValueError:
            raise ValueError(f"--budgets={text!r}: {name}'s budget {item!r} is not a number of "
                             "seconds or 'none'") from None
        if value is not None and not 0 <= value < float("inf"):
            raise ValueError(f"--budgets={text!r}: {name}'s budget {item!r} must be a finite "
                             "number of seconds >= 0")
        budgets[name] = value or None
    return budgets


def run_part(name: str, cmd: list[str], budget_s: float | None, out: Path) -> dict:
    """Run one part in its own process, its output to ``out/NAME.log``; killed at its budget
    (None: none)."""
    t = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    budget = "no budget" if budget_s is None else f"budget {budget_s:.0f} s"
    print(f"== {name}: {' '.join(cmd)} ({budget})", flush=True)
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                timeout=budget_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = (out / f"{name}.log").read_text(errors="replace")
    print(text[-3000:], flush=True)
    return {"rc": rc, "wall_s": round(time.perf_counter() - t, 1), "log_tail": text[-1500:]}


def tests_cmd(out: Path) -> list[str]:
    files = [str(ROOT / "tests" / f"{f}.py") for f in TEST_FILES]    # tests/<subsystem>/<file>
    workers = ["-n", "8"] if _has("xdist") else []
    workers += ["--timeout", "120"] if _has("pytest_timeout") else []   # a hang costs one test
    return [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
            "-rfE", *workers, *files]


def engines_cmd(out: Path, model: str, dtype: str, backend: str, quick: bool) -> list[str]:
    return [sys.executable, "-m", "minillm", "bench", "--model", model, "--dtype", dtype,
            "--engines", ENGINES, "--experiments", "none", "--attention-backend", backend,
            "--requests", "32" if quick else "128", "--naive-requests", "4",
            "--json", str(out / "engines.json"), "--no-figure"]


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


# --- part 4: the step on the device ------------------------------------------------------------
def profile_rows(model_name: str, dtype: str, backend: str, steps: int = 8) -> list[dict]:
    """Per running-batch size: a decode step's wall time (median of ``steps``) and the device's
    kernel time in one more batch of steps under the profiler. busy = kernels / wall: what is
    left is launch latency and the engine's Python, the share CUDA graphs and async scheduling
    exist to hide."""
    from torch.profiler import ProfilerActivity, profile

    from .bench.profile_step import steady_engine, time_steps
    from .models import load_model

    model = load_model(model_name, dtype=dtype)
    cuda = model.device.type == "cuda"
    rows = []
    for n in PROFILE_ROWS:
        llm = steady_engine(model, n, context=256, backend=backend)
        engine = llm.engine
        time_steps(engine, 2)                                   # warm: kernels compiled
        wall = statistics.median(time_steps(engine, steps))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                engine.step()
        kernels = busy_ms(prof) / steps
        # (on an H200 the profiled kernel time exceeded the unprofiled wall time: kept in the
        # JSON for a later check against Nsight, left out of the table)
        rows.append({"rows": n, "step_ms": round(wall, 2), "profiled_kernel_ms": round(kernels, 2),
                     "launches_per_step": sum(e.count for e in prof.key_averages()
                                              if e.key in LAUNCHES) // steps})
        del llm, engine
    return rows


def lora_kernels(model: str, out: Path) -> int:
    """Part 5's ``lora``: rung 13's bench once per adapter kernel (``triton`` compiles natively
    here; on a CPU it runs in Triton's interpreter), 8 adapters x 4 requests in one batch, Triton
    first (on an H200, sgmv's mixed batch alone took 6 s of a 120 s budget at 8 x 8 x 64 tokens)."""
    from .bench import lora
    from .engines.r13_lora.config import LORA_KERNELS
    for kernel in sorted(LORA_KERNELS, key=lambda k: k != "triton"):
        lora.main(["--model", model, "--adapters", "8", "--per-adapter", "4", "--max-tokens", "32",
                   "--lora-kernel", kernel, "--json", str(out / f"lora_{kernel}.json")])
    return 0


def busy_ms(prof) -> float:
    """Milliseconds in which the device ran at least one kernel: the union of the kernels'
    intervals (a sum would count overlapping kernels, and any event listed twice, twice)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1000


# --- the summary -------------------------------------------------------------------------------
def summarize_tests(res: dict) -> str:
    m = re.findall(r"=+ (.*?) in [\d.]+s", res.get("log_tail", ""))
    return m[-1] if m else f"rc {res['rc']}"


def summary_table(results: dict, out: Path) -> str:
    lines = ["| part | rc | wall s | result |", "|---|---|---|---|"]
    for name, res in results.items():
        what = ""
        if name == "tests":
            what = summarize_tests(res)
        elif name == "engines" and (out / "engines.json").exists():
            rows = json.loads((out / "engines.json").read_text()).get("table", [])
            what = "; ".join(f"{r['engine']} {r['output_tok_s']:.0f} tok/s" for r in rows)
        elif name == "kernels" and (out / "kernels.json").exists():
            data = json.loads((out / "kernels.json").read_text())
            what = f"copy {data.get('copy_gbps', 0):.0f} GB/s, {len(data.get('rows', []))} rows"
        elif name == "profile" and (out / "profile.json").exists():
            what = "; ".join(f"{r['rows']} rows: {r['step_ms']} ms, {r['launches_per_step']} launches"
                             for r in json.loads((out / "profile.json").read_text()))
        elif name in ("rung12", "lora", "structured"):      # their own printout's last lines
            what = " / ".join(ln.strip() for ln in res.get("log_tail", "").splitlines()[-3:])
        lines.append(f"| {name} | {res['rc']} | {res['wall_s']} | {what} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check_out", help="folder for logs and JSON")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--model", default="smollm2-random", help="for the engines and profile parts")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--budgets", default=BUDGETS,
                    help="seconds per part, in the order of --parts' default; 'none' (or 0): "
                         "no limit, for a dry run on a CPU")
    ap.add_argument("--quick", action="store_true", help="fewer requests in the engines part")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (a dry run)")
    ap.add_argument("--profile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lora-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.profile_only:
        rows = profile_rows(args.model, args.dtype, args.attention_backend)
        (out / "profile.json").write_text(json.dumps(rows, indent=1))
        print(json.dumps(rows, indent=1))
        return 0
    if args.lora_only:
        return lora_kernels(args.model, out)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: no CUDA device here (pass --allow-cpu for a dry run)", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    try:
        budgets = parse_budgets(args.budgets)
    except ValueError as e:
        ap.error(str(e))
    cmds = {"tests": tests_cmd(out),
            "kernels": [sys.executable, "-m", "minillm.bench.kernels", "--quick",
                        "--json", str(out / "kernels.json")],
            "engines": engines_cmd(out, args.model, args.dtype, args.attention_backend, args.quick),
            "profile": [sys.executable, "-m", "minillm.gpu_check", "--profile-only", "--out",
                        str(out), "--model", args.model, "--dtype", args.dtype,
                        "--attention-backend", args.attention_backend],
            "rung12": [sys.executable, "-m", "minillm.bench.async_step", "--models", args.model,
                       "--dtype", args.dtype, "--batch", "1,32,128", "--max-tokens", "64"],
            "lora": [sys.executable, "-m", "minillm.gpu_check", "--lora-only", "--out", str(out),
                     "--model", args.model],
            "structured": [sys.executable, "-m", "minillm.bench.structured_mask", "--model",
                           args.model, "--rows", "64", "--steps", "60"]}
    parts = args.parts.split(",")
    for name in parts:                       # all checked before any part starts
        if name not in cmds:
            ap.error(f"--parts: unknown part {name!r}; choose from {', '.join(PARTS)}")
    results = {name: run_part(name, cmds[name], budgets[name], out) for name in parts}
    table = summary_table(results, out)
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    print("\n" + table)
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
