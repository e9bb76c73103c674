"""One stream, N new tokens: eager vs compiled vs int8 weights (rung 14, notebook 14):
``python -m minillm.bench.one_stream``.

A single request decoding is the step with the least work per Python call: one row per matrix
product, so the step's time is the weights' bytes over the memory bandwidth plus whatever the
host adds (the Python of 30 layers, ~300 kernel launches). Each variant is an engine built once
and warmed up (the compiled one compiles its bucket for batch 1 there: that time is shown
apart), then the variants run in turn, ``--runs`` times each, alternating so that a noisy
neighbour slows all of them alike; the table shows each variant's median tok/s (the request's
wall time, its prefill included) and the dtype of its activations on every row.
"""
from __future__ import annotations

import argparse
import statistics
import time

VARIANTS = {
    "eager": {},
    "compiled": {"compile": True, "compile_buckets": "1"},
    "int8": {"quantization": "int8"},
    "w8a8": {"quantization": "w8a8"},
    "compiled+w8a8": {"compile": True, "compile_buckets": "1", "quantization": "w8a8"},
    "compiled+int8": {"compile": True, "compile_buckets": "1", "quantization": "int8"},
    "gemv": {"linear_backend": "gemv"},
    "compiled+gemv": {"compile": True, "compile_buckets": "1", "linear_backend": "gemv"},
}
# each compiled variant again with inductor's C++ wrapper (``compile_wrapper="cpp"``)
VARIANTS.update({f"{name}+cpp": {**options, "compile_wrapper": "cpp"}
                 for name, options in list(VARIANTS.items()) if options.get("compile")})
PROMPT = "Explain in a few sentences why the sky is blue."


def build(model, variant: str, kv_cache_bytes: int = 64 << 20):
    from .. import LLM
    return LLM(model, engine="paged", max_num_seqs=1, kv_cache_bytes=kv_cache_bytes,
               **VARIANTS[variant])


def one_run(llm, prompt, new_tokens: int) -> tuple[float, list[int]]:
    """(tok/s, the tokens) of one greedy request of ``new_tokens`` tokens, EOS ignored."""
    from .. import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params, progress=False)[0]
    return new_tokens / (time.perf_counter() - start), out.token_ids


def dispatches_per_token(llm, prompt, new_tokens: int = 8) -> float:
    """Calls into torch's dispatcher per generated token (``torch.profiler``'s CPU events over
    one greedy request, its prefill and sampling included): each is Python handing one op to
    torch, the host's work that a compiled step folds into one call (notebook 14)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_run(llm, prompt, new_tokens)
    return len(prof.events()) / new_tokens


def weights_floor_ms(model, quantization: str | None = None, size_mb: int = 256) -> dict:
    """The one-row step's floor: its weights' bytes (every linear weight, ``lm_head`` included,
    as ``quantization`` stores them) over this machine's read bandwidth, measured as the best of
    five copies of a ``size_mb`` MB tensor (a copy reads and writes each byte: 2x its size)."""
    import torch

    from .quant_accuracy import weight_bytes
    src = torch.ones(size_mb << 18)        # size_mb MB of fp32
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    gb_s = 2 * src.numel() * 4 / best / 1e9
    nbytes = weight_bytes(model, quantization)
    return {"weight_mb": nbytes / 1e6, "gb_s": gb_s, "floor_ms": nbytes / 1e6 / gb_s}


def product_times(out_features: int = 1536, in_features: int = 576, copies: int = 40,
                  repeats: int = 15, rows: int = 1, dtype=None) -> dict[str, float]:
    """Microseconds of one product ``x @ W.T`` of ``rows`` rows in ``dtype`` (fp32 by default;
    W in it too, or int8; SmolLM2's gate/up shape by default), best of ``repeats`` passes over ``copies`` different weights (so they come from
    memory, as in a step, not from cache), by each way the engine can compute it: ``F.linear``
    (BLAS on the plain weight, what inductor's ``mm`` calls), oneDNN on its packed copy (the
    eager engine's ``onednn`` kernel, and rung 14's ``packed_linear``), int8 ``dequant`` and
    ``int8pack`` (torch's op, where it has its AVX-512 kernel), w8a8 on ``torch._int_mm`` where
    the CPU has int8 units, rung 14's streamed kernels (``layers/gemv.py``) on fp32, int8
    and, with VNNI and fp32 rows, w8a8, and its tiles (``layers/tiled.py``) where they run."""
    import torch
    import torch.nn.functional as F

    from ..layers.linear import OneDNNLinear, onednn_works
    from ..layers.quant import Int8Linear, W8A8Linear, has_int8pack_kernel, w8a8_missing
    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=g).to(dtype)
               for _ in range(copies)]
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    fp32 = dtype == torch.float32
    ways = {"F.linear": (lambda w: w, lambda p: F.linear(x, p))}
    if onednn_works(dtype):
        k = OneDNNLinear()
        ways["onednn packed"] = (k.pack, lambda p: k(x, p))
    q = Int8Linear("dequant")
    ways["int8 dequant"] = (q.pack, lambda p: q(x, p))
    if has_int8pack_kernel():
        ways["int8 int8pack"] = (q.pack, lambda p: Int8Linear("int8pack")(x, p))
    if w8a8_missing() is None and fp32:
        a = W8A8Linear()
        ways["w8a8 _int_mm"] = (a.pack, lambda p: a(x, p))
    from ..layers import gemv
    if gemv.load() is not None and rows <= gemv.MAX_ROWS:
        ways["gemv"] = (lambda w: w, lambda p: gemv.gemv(x, p))
        ways["gemv int8"] = (q.pack, lambda p: gemv.gemv(x, p[0], p[1]))
        if gemv.load().has_vnni() and fp32:
            v = gemv.W8A8GemvLinear()
            ways["gemv w8a8"] = (v.pack, lambda p: v.stream(x, p))
    from ..layers import tiled
    if dtype in tiled.dtypes():
        ways["tiled"] = (tiled.load().pack, lambda p: tiled.tiled(x, p))
    out = {}
    for name, (pack, call) in ways.items():
        packed = [pack(w) for w in weights]
        for p in packed:
            call(p)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for p in packed:
                call(p)
            best = min(best, (time.perf_counter() - start) / copies)
        out[name] = best * 1e6
    return out


def page_times(config, passes: int = 9) -> dict[str, float]:
    """Milliseconds of one step's int8 products at one row (every layer's q/k/v, o, gate/up and
    down, and the LM head, in ``config``'s shapes; random codes), best of ``passes`` alternating
    passes, with the weights where torch allocates them (4 KiB pages) and gathered into one buffer
    on huge pages (``runtime/heap.py``, what ``load_model`` and ``PagedLlama`` do), through
    ``gemv_w8a8`` where the CPU has VNNI, else the streamed int8 kernel."""
    import torch

    from ..layers import gemv
    from ..runtime.heap import gather
    hid, inter, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or hid // heads
    qkv = (heads + 2 * config.num_key_value_heads) * d
    shapes = [(qkv, hid), (hid, heads * d), (2 * inter, hid), (hid, inter)] * \
        config.num_hidden_layers + [(config.vocab_size, hid)]
    g = torch.Generator().manual_seed(0)
    plain = [torch.randint(-127, 128, s, dtype=torch.int8, generator=g) for s in shapes]
    huge = gather(plain)
    scales = [torch.rand(s[0], generator=g) for s in shapes]
    xs = {n: torch.randn(1, n, generator=g) for n in {i for _, i in shapes}}
    op = torch.ops.minillm.gemv_w8a8 if gemv.load().has_vnni() else torch.ops.minillm.gemv
    best = {"4 KiB pages": float("inf"), "huge pages": float("inf")}
    for _ in range(passes):
        for name, ws in (("4 KiB pages", plain), ("huge pages", huge)):
            start = time.perf_counter()
            for w, s in zip(ws, scales):
                op(xs[w.shape[1]], w, s, None, None)
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    best["MB"] = sum(w.numel() for w in plain) / 1e6
    return best


def on_another_thread(fn, *args):
    """``fn(*args)`` run on a new thread, waited for: a step taken off the thread whose torch work
    built the engine (two OpenMP teams in the process; docs/USING.md, dtype and threads)."""
    import threading
    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn(*args)))
    worker.start()
    worker.join()
    return box[0]


def measure(model, variants=("eager", "compiled", "int8"), new_tokens: int = 128,
            runs: int = 3, progress=print, text: str = PROMPT,
            elsewhere: bool = False) -> list[dict]:
    """``elsewhere``: each timed request runs on a second thread (``on_another_thread``)."""
    prompt = {"messages": [{"role": "user", "content": text}]}
    engines, setup = {}, {}
    for v in variants:
        start = time.perf_counter()
        engines[v] = build(model, v)
        one_run(engines[v], prompt, 4)                # warm-up: the compiled one compiles here
        setup[v] = time.perf_counter() - start
        if progress:
            progress(f"{v}: built and warmed up in {setup[v]:.1f} s")
    speeds: dict[str, list[float]] = {v: [] for v in variants}
    tokens: dict[str, list[int]] = {}
    for r in range(runs):
        for v in variants:
            if elsewhere:
                tps, tokens[v] = on_another_thread(one_run, engines[v], prompt, new_tokens)
            else:
                tps, tokens[v] = one_run(engines[v], prompt, new_tokens)
            speeds[v].append(tps)
        if progress:
            progress(f"run {r + 1}/{runs}: " + ", ".join(f"{v} {speeds[v][-1]:.1f}"
                                                         for v in variants))
    ref = tokens[variants[0]]
    dtype = str(model.dtype).replace("torch.", "")
    return [{"variant": v, "dtype": dtype,
             "weights": VARIANTS[v].get("quantization") or dtype,
             "tok_s_median": statistics.median(speeds[v]), "tok_s_runs": speeds[v],
             "setup_s": setup[v], "new_tokens": new_tokens,
             "compile_s": engines[v].engine.describe().get("compile_s"),
             "same_tokens_as_first": tokens[v] == ref} for v in variants]


def format_table(rows: list[dict]) -> str:
    base = rows[0]["tok_s_median"]
    lines = ["| variant | activations | weights | tok/s (median) | runs | vs first | setup s "
             "(compile) | tokens = first row's |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = " ".join(f"{x:.1f}" for x in r["tok_s_runs"])
        lines.append(f"| {r['variant']} | {r['dtype']} | {r['weights']} | "
                     f"{r['tok_s_median']:.1f} | {runs} | {r['tok_s_median'] / base:.2f}x | "
                     f"{r['setup_s']:.1f} | {r['same_tokens_as_first']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    from ..models import DEFAULT_MODEL, load_model
    p = argparse.ArgumentParser(prog="python -m minillm.bench.one_stream",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt", default=PROMPT, help="the one chat message the stream answers")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--variants", default="eager,compiled,int8",
                   help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--products", action="store_true",
                   help="also time one product each way it can be computed (µs)")
    p.add_argument("--product-rows", type=int, default=1,
                   help="rows of x in --products (a prefill's are many; a decode step's few)")
    p.add_argument("--pages", action="store_true",
                   help="also time a step's int8 products on 4 KiB pages and on huge pages")
    p.add_argument("--on-another-thread", action="store_true",
                   help="time each request on a second thread, not the one that built the engine")
    p.add_argument("--accuracy", action="store_true",
                   help="also print int8's accuracy figures (bench/quant_accuracy.py)")
    args = p.parse_args(argv)
    variants = tuple(args.variants.split(","))
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant {bad[0]!r}: choose from {', '.join(VARIANTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype)
    print(f"{args.model}, one stream, {args.new_tokens} new tokens, {args.runs} alternating runs,"
          f" {torch.get_num_threads()} threads, activations {model.dtype}")
    rows = measure(model, variants, args.new_tokens, args.runs, text=args.prompt,
                   elsewhere=args.on_another_thread)
    print(format_table(rows))
    if args.products:
        fp32 = 1536 * 576 * 4
        for name, us in product_times(rows=args.product_rows, dtype=model.dtype).items():
            print(f"{args.product_rows} row(s) x 576 -> 1536, {str(model.dtype)[6:]}, "
                  f"{name:14s} {us:8.1f} µs  ({fp32 / us / 1e3:.1f} GB/s of fp32 weight)")
    if args.pages:
        t = page_times(model.config)
        print(f"a step's int8 products at one row, {t['MB']:.0f} MB: "
              + ", ".join(f"{k} {t[k]:.2f} ms ({t['MB'] / t[k]:.1f} GB/s)"
                          for k in ("4 KiB pages", "huge pages")))
    if args.accuracy:
        from .quant_accuracy import measure as accuracy
        accuracy(model, ("int8",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
