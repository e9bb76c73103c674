"""Where a decode step's time goes: ``python -m minillm.bench.profile_step`` (``make profile``).

The paged engine is filled with N sequences in steady decode (each ``--context`` tokens into its
answer), then K decode steps are timed, and one more batch of steps runs under ``torch.profiler``
to split the step into components: the linear layers, attention (everything inside
``paged_attention``: writing the new K/V, reading the cache, the softmax), the rest of the forward
(norms, RoPE, embedding), the vocabulary projection, sampling, and the engine's own Python
(scheduling, block manager, the commit point).

Beside each row, the floor: the same model's linear layers alone on N rows, through the fastest
linear kernel here (rung 14's ``tiled`` where it is the faster one, layers/tiled.py; else oneDNN
on weights reordered once, as ``torch.compile(freezing=True)`` would run them; layers/linear.py),
and how close that chain comes to this CPU's matmul peak in the same dtype (a large square GEMM
through the default kernel, oneDNN's on a CPU). "ratio" = step time / that chain. ``--dtype
float32,bfloat16`` alternates the model's dtypes row by row (bf16: AMX / AVX512-BF16 units). Speed is a ratio measured
in one run: the machine is noisy; targets live here and in ``make bench``, never in timed tests.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..layers import tiled
from ..layers.linear import get_linear_kernel, matmul_gflops
from ..core.model import PagedLlama

COMPONENTS = ("linear", "attention", "other forward", "logits", "sample", "engine python")


def steady_engine(model, rows: int, context: int, backend: str | None = None,
                  linear: str | None = None, kv_cache_dtype: str = "auto",
                  layer_ops: str | None = None):
    """A paged engine with ``rows`` sequences, each ``context`` tokens long and decoding."""
    from ..llm import LLM
    from ..request import Request, SamplingParams

    blocks = rows * (-(-(context + 64) // 16)) + 8
    llm = LLM(model, engine="paged", block_size=16, num_blocks=blocks, max_num_seqs=rows,
              max_num_batched_tokens=max(2048, context), attention_backend=backend,
              linear_backend=linear, kv_cache_dtype=kv_cache_dtype, layer_ops=layer_ops)
    engine = llm.engine
    prompt = list(range(100, 100 + context))       # distinct prompts: no prefix-cache sharing
    for i in range(rows):
        engine.add_request(Request([t + i for t in prompt], SamplingParams(
            max_tokens=10_000, ignore_eos=True), request_id=f"p{i}"))
    while any(s.num_computed_tokens < s.prompt_len for g in engine.groups.values() for s in g.seqs):
        engine.step()
    engine.step()                                  # the first decode step of every sequence
    return llm


def time_steps(engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        out.append((time.perf_counter() - t) * 1000)
    return out


def linear_chain(net, rows: int):
    """Every linear layer of ``net`` (and the vocabulary projection) on ``rows`` rows, through
    its own ``Linear`` kernels: a function running it once, and its FLOPs."""
    dtype = net.embed.dtype
    x = torch.randn(rows, net.embed.shape[1], dtype=dtype)
    y = torch.randn(rows, net.layers[0].down.weight.shape[1], dtype=dtype)
    a = torch.randn(rows, net.layers[0].o.weight.shape[1], dtype=dtype)

    def once():
        for w in net.layers:
            w.qkv(x), w.o(a), w.gate_up(x), w.down(y)
        net.lm_head(x)
    linears = [lin for w in net.layers for lin in (w.qkv, w.o, w.gate_up, w.down)]
    flops = 2 * rows * sum(lin.weight.numel() for lin in [*linears, net.lm_head])
    return once, flops


def median_ms(fn, repeats: int) -> float:
    fn()                                            # warm-up: first calls allocate
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def linear_floor_ms(net, rows: int, repeats: int = 5) -> tuple[float, float]:
    """(ms, GFLOP/s) of ``linear_chain`` on ``rows`` rows."""
    once, flops = linear_chain(net, rows)
    ms = median_ms(once, repeats)
    return ms, flops / ms / 1e6


LINEAR_OPS = ("aten::linear", "mkldnn::_linear_pointwise",   # torch's / oneDNN's kernel
              "minillm::gemv", "minillm::gemv_w8a8", "minillm::tiled_mm")      # rung 14's


def classify(name: str) -> str | None:
    if name in LINEAR_OPS:         # (inclusive time: aten::linear's addmm/mm are inside it)
        return "linear"
    if name.startswith("minillm::"):
        return name.removeprefix("minillm::")
    return None


def breakdown(engine, steps: int) -> dict[str, float]:
    """Milliseconds per step in each component, from a ``torch.profiler`` run of ``steps`` steps:
    the engine's ``record_function`` scopes, with linear layers counted apart."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("minillm::step"):
                engine.step()
    totals = {k: 0.0 for k in ("step", *COMPONENTS, "forward")}
    for evt in prof.key_averages():
        key = classify(evt.key)
        if key in totals:
            totals[key] += evt.cpu_time_total / 1000 / steps
    # linear layers run inside the forward but outside attention; the rest of the forward is
    # what the forward took minus its parts; the engine's Python is the step minus everything
    fwd = totals.pop("forward")
    step = totals.pop("step")
    totals["linear"] = max(0.0, totals["linear"] - totals["logits"])   # the vocab matmul apart
    totals["other forward"] = max(0.0, fwd - totals["linear"] - totals["attention"])
    totals["engine python"] = max(0.0, step - fwd - totals["logits"] - totals["sample"])
    totals["step"] = step
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.profile_step", description=__doc__)
    p.add_argument("--rows", default="1,16,64,128,256", help="running sequences, comma-separated")
    p.add_argument("--context", type=int, default=155, help="tokens per sequence (default 155)")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per row count")
    p.add_argument("--backend", default=None,
                   help="attention backend(s), comma-separated: torch, cpp, triton (default: the "
                        "engine's default); several backends alternate row by row in one run")
    p.add_argument("--linear", default=None,
                   help="the engine's linear kernel(s), comma-separated: torch, onednn, gemv, "
                        "tiled (default: the engine's default); the floor always uses the "
                        "fastest kernel here")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="how the KV pool stores K/V, comma-separated: auto, float16, bfloat16, "
                        "int8, fp8 (rung 9); several alternate row by row in one run")
    p.add_argument("--layer-ops", default=None,
                   help="a layer's norm/RoPE/SiLU, comma-separated: fused, eager (default: the "
                        "engine's: fused for bf16 on the CPU); several alternate row by row")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto",
                   help="the model's dtype(s), comma-separated: auto, float32, bfloat16 (default "
                        "auto: bf16 where this CPU computes it natively); several alternate")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one per core)")
    p.add_argument("--chains", default=None,
                   help="instead of steps: the linear chain alone (every product of a step) "
                        "through each of these kernels, comma-separated, e.g. onednn,tiled; "
                        "alternated pass by pass, median of --steps passes")
    p.add_argument("--busy", type=int, default=0,
                   help="keep this many cores busy with other processes while measuring (a "
                        "shared machine; with OMP_WAIT_POLICY=PASSIVE in the environment too)")
    args = p.parse_args(argv)
    with busy_cores(args.busy):
        return run(args)


@contextlib.contextmanager
def busy_cores(n: int):
    """``n`` processes spinning on the CPU for the ``with`` block: other jobs on a shared machine."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def run(args: argparse.Namespace) -> int:
    from ..engines import get_attention_backend
    from ..models import dtype_name, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.chains:
        for d in args.dtype.split(","):
            compare_chains(load_model(args.model, dtype=d), args.chains.split(","),
                           [int(r) for r in args.rows.split(",")], args.steps)
        return 0
    setups = [dtype_setup(load_model(args.model, dtype=d)) for d in args.dtype.split(",")]
    model = setups[0][0]
    backends = (args.backend or get_attention_backend(None, model.device).name).split(",")
    print(f"decode step, {args.context} tokens of context, {torch.get_num_threads()} thread(s), "
          f"{args.busy} core(s) busy, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}; "
          + "; ".join(f"{dtype_name(m.dtype)} matmul peak {peak:.0f} GFLOP/s (default kernel, "
                      f"2048^3)" for m, _, peak, _ in setups) + "\n")
    head = f"{'rows':>5} {'dtype':>8} {'attention':>9} {'ops':>6} {'linear':>6} {'kv':>8} " \
        f"{'ms/step':>8} " \
        f"{'tok/s':>7} {'floor':>9} {'ratio':>6} {'floor GF/s':>10} {'of peak':>7}  " + \
        "  ".join(f"{c:>13}" for c in COMPONENTS) + f"  {'p90 ms':>7}"
    print(head)
    for rows in (int(r) for r in args.rows.split(",")):
        for (model, fastest, peak, floor_net), backend in \
                ((s, b) for s in setups for b in backends):
            linears = (args.linear or fastest.name).split(",")
            ops = args.layer_ops.split(",") if args.layer_ops else [None]
            for linear, kv, op in ((a, b, c) for a in linears
                                   for b in args.kv_cache_dtype.split(",") for c in ops):
                llm = steady_engine(model, rows, args.context, backend, linear, kv, op)
                times = sorted(time_steps(llm.engine, args.steps))
                ms, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
                parts = breakdown(llm.engine, max(2, args.steps // 2))
                floor, gflops = linear_floor_ms(floor_net, rows)
                shares = "  ".join(f"{100 * parts[c] / parts['step']:>12.0f}%"
                                   for c in COMPONENTS)
                print(f"{rows:>5} {dtype_name(model.dtype):>8} {llm.engine.backend.name:>9} "
                      f"{llm.engine.describe()['layer_ops']:>6} "
                      f"{linear:>6} {kv:>8} {ms:>8.1f} {rows * 1000 / ms:>7.0f} {floor:>7.1f}ms "
                      f"{ms / floor:>6.2f} {gflops:>10.0f} {100 * gflops / peak:>6.0f}%  {shares}"
                      f"  {p90:>7.1f}", flush=True)
                del llm
    return 0


def compare_chains(model, kernels: list[str], rows_list: list[int], passes: int) -> None:
    """The linear chain alone (``linear_chain``) through each kernel, the kernels alternated pass
    by pass so a noisy minute touches all of them: ms and GFLOP/s, and each kernel's speed
    against the first one's."""
    from ..models import dtype_name
    nets = {k: PagedLlama(model.hf_model, get_linear_kernel(k, model.device, model.dtype))
            for k in kernels}
    for rows in rows_list:
        chains = {k: linear_chain(net, rows) for k, net in nets.items()}
        times = {k: [] for k in kernels}
        for k, (once, _) in chains.items():
            once()                                  # warm-up: first calls allocate
        for _ in range(max(1, passes)):
            for k, (once, _) in chains.items():
                t = time.perf_counter()
                once()
                times[k].append((time.perf_counter() - t) * 1000)
        ms = {k: statistics.median(v) for k, v in times.items()}
        print(f"{rows:>5} rows {dtype_name(model.dtype):>8}  " + "  ".join(
            f"{k} {ms[k]:.1f} ms ({chains[k][1] / ms[k] / 1e6:.0f} GF/s, "
            f"{ms[kernels[0]] / ms[k]:.2f}x)" for k in kernels), flush=True)


def dtype_setup(model) -> tuple:
    """(model, its fastest linear kernel, that kernel's matmul peak in the model's dtype, the
    model's layers on that kernel: the floor's chain)."""
    default = get_linear_kernel(None, model.device, model.dtype)
    peak = matmul_gflops(default, dtype=model.dtype)      # a large square product: oneDNN's
    fastest = (get_linear_kernel("tiled", model.device, model.dtype)
               if tiled.preferred(model.device, model.dtype) else default)
    return model, fastest, peak, PagedLlama(model.hf_model, fastest)


if __name__ == "__main__":
    raise SystemExit(main())
