"""llama.cpp as the one-stream peer (rung 14, docs/rungs/14_compiled.md): ``make bench-llamacpp``.

llama.cpp is what most people run a small model on a CPU with, and it is the peer a single
stream is measured against: no batching to hide the host's work per step. It never goes into the
project's environment. ``ensure_build`` takes the llama.cpp that the ``llama-cpp-python`` sdist
vendors (a pinned version, fetched once from PyPI, built once with CMake, ``-DGGML_NATIVE=ON``:
~10-15 min on 2 cores, kept in ``.llamacpp/``); ``ensure_gguf`` converts the same SmolLM2
directory minillm loads with llama.cpp's own ``convert_hf_to_gguf.py`` (f32, bf16) and
``llama-quantize``s q8_0.

Fair: llama.cpp gets the threads minillm computes with (``-t``), the same model, the same number
of new tokens; runs alternate (``--rounds``), so a noisy neighbour hits both. Every row names
its dtype and weight format: f32 against fp32, bf16 against bf16, q8_0 against minillm's own
8-bit weights where it has them (``--quantization``), and both store K/V alike (``--kv``: 16
bits by default, llama.cpp's own default). One stream is ``llama-bench -n N -p 0``
(generation only) against minillm's decode steps after a one-token prompt; batches are
``llama-batched-bench`` (B x prompt, B x N new tokens, output tokens per second of the whole
run, prefill included) against the paged engine on the same shape.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from ..engines.r14_compiled.config import WRAPPERS

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / ".llamacpp"
VERSION = "0.3.36"          # llama-cpp-python's sdist: which llama.cpp it vendors
SIMPLE = "https://pypi.org/simple/llama-cpp-python/"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-simple")
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


# --- build and convert (once) -----------------------------------------------------------------
def sources() -> Path:
    """The vendored llama.cpp of llama-cpp-python ``VERSION`` (downloaded and unpacked once)."""
    src = HOME / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    HOME.mkdir(parents=True, exist_ok=True)
    sdist = HOME / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        index = urllib.request.urlopen(SIMPLE, timeout=60).read().decode()
        name = f"llama_cpp_python-{VERSION}.tar.gz"
        hrefs = [h.split('"')[0] for h in index.split('href="')[1:] if name in h.split('"')[0]]
        if not hrefs:
            raise RuntimeError(f"{SIMPLE} lists no {name}")
        url = urllib.parse.urljoin(SIMPLE, hrefs[0].split("#")[0])
        print(f"[llama.cpp] downloading {name} (~75 MB)", flush=True)
        urllib.request.urlretrieve(url, sdist)
    with tarfile.open(sdist) as tar:
        tar.extractall(HOME, filter="data")
    return src


def ensure_build(threads: int = 2) -> Path:
    """llama.cpp's tools, built for this CPU (``GGML_NATIVE``); returns their folder."""
    src = sources()
    bin_dir = src / "build" / "bin"
    if all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    print("[llama.cpp] building with CMake (once, ~10-15 min on 2 cores)", flush=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(src / "build"), "--config", "Release", "-j",
                    str(threads), "--target", *TARGETS], check=True)
    return bin_dir


def ensure_gguf(kind: str) -> Path:
    """SmolLM2 as a GGUF file of ``kind`` (f32, bf16 or q8_0), converted from the directory
    minillm loads (``models.ensure_smollm2_cache``) by llama.cpp's own converter."""
    from ..models import ensure_smollm2_cache

    out = HOME / f"smollm2-135m-instruct-{kind}.gguf"
    if out.exists():
        return out
    src = sources()
    if kind == "q8_0":
        f32 = ensure_gguf("f32")
        subprocess.run([str(ensure_build() / "llama-quantize"), str(f32), str(out), "q8_0"],
                       check=True, stdout=subprocess.DEVNULL)
        return out
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(converter_deps())])}
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(ensure_smollm2_cache()),
                    "--outtype", kind, "--outfile", str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return out


def converter_deps() -> Path:
    """What ``convert_hf_to_gguf.py`` imports beyond torch, numpy and transformers (which it
    shares with minillm): sentencepiece, installed into a folder of its own (``pip --target``),
    never into the project's environment."""
    target = HOME / "converter-deps"
    if not (target / "sentencepiece").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                        "--no-deps", "sentencepiece"], check=True)
    return target


# --- llama.cpp's numbers ------------------------------------------------------------------------
def llama_one_stream(model: Path, new_tokens: int, threads: int, kv: str = "f16") -> float:
    """Generation tok/s of one stream (``llama-bench -n N -p 0``, its mean over 5 repetitions),
    K and V stored as ``kv`` (llama.cpp's default: f16)."""
    out = subprocess.run([str(ensure_build() / "llama-bench"), "-m", str(model), "-t", str(threads),
                          "-n", str(new_tokens), "-p", "0", "-r", "5", "-o", "json",
                          "-ctk", kv, "-ctv", kv],
                         check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def llama_batched(model: Path, batch: int, prompt: int, new_tokens: int, threads: int,
                  kv: str = "f16") -> float:
    """Output tok/s of ``batch`` streams, prefill included (``llama-batched-bench``), K and V
    stored as ``kv``."""
    out = subprocess.run([str(ensure_build() / "llama-batched-bench"), "-m", str(model),
                          "-ctk", kv, "-ctv", kv,
                          "-t", str(threads), "-tb", str(threads), "-c",
                          str(batch * (prompt + new_tokens) + 16), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt), "-ntg", str(new_tokens), "-npl", str(batch),
                          "--output-format", "jsonl"],
                         check=True, capture_output=True, text=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return batch * new_tokens / float(row["t"])


def llama_greedy_text(model: Path, prompt: str, new_tokens: int, threads: int) -> str:
    """What llama.cpp's ``llama-simple`` (greedy) prints after ``prompt``."""
    out = subprocess.run([str(ensure_build() / "llama-simple"), "-m", str(model), "-n",
                          str(new_tokens), prompt], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    return out.split(prompt, 1)[-1] if prompt in out else out


# --- minillm's numbers, the same work -----------------------------------------------------------
def minillm_engine(dtype: str, quantization: str | None = None, max_num_seqs: int = 64,
                   compile_buckets: str | None = None, linear_backend: str | None = None,
                   compile_wrapper: str = "python", kv_cache_dtype: str = "auto"):
    """The paged engine on SmolLM2 in ``dtype``; with ``compile_buckets`` rung 14's compiled
    engine, each bucket compiled here by a short warm-up (never inside a timed run)."""
    from ..engines import create_engine
    from ..models import load_model

    options = {"max_num_seqs": max_num_seqs, "kv_cache_dtype": kv_cache_dtype}
    if quantization:
        options["quantization"] = quantization
    if compile_buckets:
        options.update(compile=True, compile_buckets=compile_buckets,
                       compile_wrapper=compile_wrapper)
    if linear_backend and not quantization:
        options["linear_backend"] = linear_backend
    engine = create_engine("paged", load_model("smollm2-135m-instruct", dtype=dtype), **options)
    for b in (map(int, compile_buckets.split(",")) if compile_buckets else ()):
        minillm_batched(engine, b, 4, 2)          # a decode step of b rows: compiles bucket b
    return engine


def minillm_one_stream(engine, new_tokens: int) -> float:
    """Decode tok/s of one stream: the steps after a one-token prompt's first."""
    from ..request import Request
    from ..sampling_params import SamplingParams

    req = Request([engine.tokenizer.bos_token_id or 1],
                  SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True), request_id="one")
    engine.add_request(req)
    engine.step()                                   # the prompt and the first token
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return new_tokens / (time.perf_counter() - t)


def minillm_batched(engine, batch: int, prompt: int, new_tokens: int) -> float:
    from ..lab.reference import random_prompts
    from ..request import Request
    from ..sampling_params import SamplingParams

    prompts = random_prompts(batch, seed=14, lo=prompt, hi=prompt)
    reqs = [Request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                    request_id=f"b{i}") for i, p in enumerate(prompts)]
    t = time.perf_counter()
    engine.run(reqs)
    return batch * new_tokens / (time.perf_counter() - t)


def greedy_agreement(engine, gguf: Path, threads: int, new_tokens: int = 32) -> dict:
    """Both engines' greedy continuation of one plain prompt, as text (llama-simple prints text):
    equal in f32 is the check that the peer runs the same model."""
    from ..sampling_params import SamplingParams

    prompt = "The capital of France is"
    ids = engine.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    ours = engine.run([__import__("minillm").Request(ids, SamplingParams(max_tokens=new_tokens),
                                                     request_id="agree")]).outputs[0].text
    theirs = llama_greedy_text(gguf, prompt, new_tokens, threads)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)))
    return {"prompt": prompt, "minillm": ours, "llama.cpp": theirs, "same_chars": same}


# How each engine stores K and V (``--kv``): "16-bit", llama.cpp's default (f16 whatever the
# weights) and minillm's 16-bit pool of the same size (rung 9's float16 beside fp32 weights, the
# model's own bf16 beside bf16 ones); or "model", both in the weights' dtype (llama.cpp told
# ``-ctk``/``-ctv``). Until 2026-12-07 the rows compared minillm's fp32 pool with llama.cpp's
# f16 one: twice the bytes for minillm's attention to read in the fp32 rows.
KV_POLICIES = ("16-bit", "model")


# llama-bench (one stream) parses fewer cache types than llama-batched-bench: no f32 ("error:
# invalid parameter for argument: -ctk"); its one-stream rows then keep its default, f16 -- at
# 128 tokens of context the cache is a small part of a step
LLAMA_BENCH_KV = ("f16", "bf16", "q8_0")


def kv_types(policy: str, dtype: str, kind: str) -> tuple[str, str]:
    """(minillm's kv_cache_dtype, llama.cpp's cache type) for weights ``dtype`` / ``kind``."""
    if policy == "model":
        return "auto", "f32" if dtype == "float32" else "bf16"     # q8_0's rows compute in fp32
    return ("float16" if dtype == "float32" else "auto"), "f16"


# --- the table ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="32,64", help="llama-batched-bench rows ('' for none)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per batched stream")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best is kept")
    ap.add_argument("--quantization", default=None,
                    help="minillm's 8-bit weights against llama.cpp's q8_0 (e.g. int8)")
    ap.add_argument("--threads", type=int, default=None, help="default: minillm's torch threads")
    ap.add_argument("--linear-backend", default=None,
                    help="minillm's linear kernel for the unquantized rows (e.g. gemv, rung 14)")
    ap.add_argument("--compile", action="store_true",
                    help="minillm's compiled step (rung 14): one bucket per row count measured")
    ap.add_argument("--compile-wrapper", default="python", choices=WRAPPERS,
                    help="with --compile: inductor's 'python' or 'cpp' wrapper (rung 14)")
    ap.add_argument("--kv", default="16-bit", choices=KV_POLICIES,
                    help="how both store K/V: '16-bit' (llama.cpp's default f16; minillm float16 "
                         "beside fp32 weights, bf16 beside bf16) or 'model' (the weights' dtype)")
    ap.add_argument("--json", default="figures/bench_llamacpp.json")
    args = ap.parse_args(argv)
    if args.compile_wrapper != "python" and not args.compile:
        ap.error("--compile-wrapper applies to the compiled step: add --compile")
    import torch

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    ensure_build(threads)
    batches = [int(b) for b in args.batches.split(",") if b]
    rows, agree = [], None
    work = [(d, GGUF_TYPES[d], None) for d in args.dtypes.split(",")]
    if args.quantization:
        work.append(("float32", "q8_0", args.quantization))
    for dtype, kind, quant in work:
        buckets = ",".join(map(str, sorted({1, *batches}))) if args.compile else None
        ours_kv, their_kv = kv_types(args.kv, dtype, kind)
        gguf, engine = ensure_gguf(kind), minillm_engine(dtype, quant, compile_buckets=buckets,
                                                         linear_backend=args.linear_backend,
                                                         compile_wrapper=args.compile_wrapper,
                                                         kv_cache_dtype=ours_kv)
        if kind == "f32":
            agree = greedy_agreement(engine, gguf, threads)
            print(f"greedy, f32: the same first {agree['same_chars']} characters of "
                  f"{len(agree['minillm'])} ({agree['minillm']!r})", flush=True)
        shapes = [("one stream", 1)] + [(f"{b} x ({args.prompt} in, {args.new_tokens} out)", b)
                                        for b in batches]
        for label, b in shapes:
            ours, theirs = [], []
            kv = their_kv if b > 1 or their_kv in LLAMA_BENCH_KV else "f16"
            for _ in range(args.rounds):            # alternating: the same noise for both
                if b == 1:
                    theirs.append(llama_one_stream(gguf, args.new_tokens, threads, kv))
                    ours.append(minillm_one_stream(engine, args.new_tokens))
                else:
                    theirs.append(llama_batched(gguf, b, args.prompt, args.new_tokens, threads,
                                                kv))
                    ours.append(minillm_batched(engine, b, args.prompt, args.new_tokens))
            kernel = quant or args.linear_backend
            compiled = "" if not buckets else "+compiled" + (
                "" if args.compile_wrapper == "python" else f"+{args.compile_wrapper}-wrapper")
            name = f"{dtype}{'+' + kernel if kernel else ''}{compiled}"
            row = {"work": label, "minillm": name,
                   "minillm_kv": dtype if ours_kv == "auto" else ours_kv, "llama.cpp": kind,
                   "llamacpp_kv": kv, "minillm_tok_s": max(ours), "llamacpp_tok_s": max(theirs),
                   "ratio": max(ours) / max(theirs), "threads": threads,
                   # each round's pair, side by side: steadier than the best of each on a noisy
                   # machine (one round's llama.cpp and minillm share its noise)
                   "median_round_ratio": statistics.median(o / t for o, t in zip(ours, theirs)),
                   "rounds": len(ours)}
            rows.append(row)
            print(f"{label:28s} minillm {row['minillm']:>23s} (KV {row['minillm_kv']}) "
                  f"{row['minillm_tok_s']:7.1f} tok/s | llama.cpp {kind:>5s} (KV {kv}) "
                  f"{row['llamacpp_tok_s']:7.1f} tok/s | "
                  f"{row['ratio']:.2f}x (best of {len(ours)} each; median of the rounds' "
                  f"ratios {row['median_round_ratio']:.2f}x)", flush=True)
        del engine
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"llama_cpp_python": VERSION, "rows": rows,
                                           "greedy_f32": agree}, indent=1))
    print(f"[llama.cpp] wrote {args.json}")


if __name__ == "__main__":
    main()
