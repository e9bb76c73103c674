"""Micro-benchmark of rung 4's Triton kernels: ``python -m minillm.bench.kernels [--quick]``.

On a CUDA GPU it times, for one attention layer of a Llama-3-8B-shaped model (32 query heads,
8 KV heads, head_dim 128, fp16):

* ``store_kv`` against ``TorchAttention.write_kv`` (``index_copy_``), for a chunk of new tokens;
* ``paged_decode`` single-pass and split-KV against ``TorchAttention.decode`` (gather + SDPA) and
  against SDPA on K/V that already sit contiguously (the best a non-paged cache could do);
* ``paged_extend`` (a chunk of new tokens after a cached prefix) against the same two baselines;

over batch sizes, context lengths and block sizes. Decode is memory-bound, so next to the time it
reports the achieved bandwidth (bytes of K/V, q and out that must move, divided by the time) as a
fraction of what a plain large ``copy_`` reaches on this device: close to 1 means the kernel
streams the cache about as fast as the hardware can.

Without a GPU Triton's timings would be meaningless (its kernels run in a numpy interpreter), so
on the CPU it times the decode attention that does run there -- rung 3's torch reference (gather,
then SDPA), the C++ kernel that reads blocks in place, SDPA on contiguous K/V -- in SmolLM2's
shape, then runs a small correctness sweep of the Triton kernels and exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from ..layers.attention.triton import triton_available  # sets TRITON_INTERPRET first on CPU
from ..layers.attention.reference import AttentionMetadata, TorchAttention
from .cpu_attention import cpu_decode_rows, read_bandwidth_gbps
from .paged_kv import Paged, contiguous_kv, make_paged

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
EXTEND_CHUNK = 512            # new tokens per sequence in the extend benchmark
MAX_EXTEND_TOKENS = 16384     # skip extend cases with more query tokens than this in one step


def extend_meta(p: Paged, q_lens: list[int], lens: list[int]) -> AttentionMetadata:
    device = p.tables.device
    empty = torch.empty(0, dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=empty.long(), num_decode=0, decode_block_tables=empty[:, None],
        decode_context_lens=empty, prefill_block_tables=p.tables,
        prefill_cu_seqlens_q=torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32),
        prefill_context_lens=p.context_lens, prefill_q_lens=q_lens, prefill_ctx_lens=lens)


def new_kv(p: Paged, q_lens: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' K/V (already in the cache), flat: ``TorchAttention.extend`` wants them."""
    ks, vs = [], []
    for s, (n, c) in enumerate(zip(q_lens, lens)):
        ks.append(TorchAttention.gather(p.k_cache, p.tables[s:s + 1], c)[0, c - n:])
        vs.append(TorchAttention.gather(p.v_cache, p.tables[s:s + 1], c)[0, c - n:])
    return torch.cat(ks), torch.cat(vs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# ----------------------------------------------------------------------------------------------
# Correctness sweep (the CPU path; also run first on a GPU)
# ----------------------------------------------------------------------------------------------
def correctness_sweep(quick: bool, device: str, tol: float = 1e-4) -> bool:
    from ..layers.attention.triton import kernels

    torch.manual_seed(0)
    ref, ok = TorchAttention(), True
    head_dim = 16
    scale = head_dim ** -0.5
    print(f"{'case':<44} {'max rel err':>12}")
    for bs in ((16,) if quick else (8, 16, 32)):
        # store_kv: must match index_copy_ exactly
        shape = (6, bs, 2, head_dim)
        kc, vc = torch.randn(shape, device=device), torch.randn(shape, device=device)
        caches = [kc, vc, kc.clone(), vc.clone()]
        kn, vn = torch.randn(2, 9, 2, head_dim, device=device)
        slots = torch.randperm(6 * bs, device=device)[:9]
        kernels.store_kv(kn, vn, caches[0], caches[1], slots)
        ref.write_kv(kn, vn, caches[2], caches[3], slots)
        exact = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        ok &= exact
        print(f"{f'store_kv bs={bs}':<44} {'exact' if exact else 'MISMATCH  FAIL':>12}")
        lens = [1, bs, bs + 1, 3 * bs + 2]
        for heads, kv in ((3, 3), (6, 2)):
            p = make_paged(lens, bs, kv, head_dim, torch.float32, device)
            q = torch.randn(len(lens), heads, head_dim, device=device)
            want = ref.decode(q, p.k_cache, p.v_cache, p.tables, p.context_lens, scale)
            errs = {}
            for splits in (1, 3):
                got = kernels.paged_decode(q, p.k_cache, p.v_cache, p.tables, p.context_lens,
                                           scale, num_splits=splits)
                errs[f"decode bs={bs} H={heads} kv={kv} splits={splits}"] = rel_err(got, want)
            q_lens = [1, bs, 1, bs + 3]
            qx = torch.randn(sum(q_lens), heads, head_dim, device=device)
            meta = extend_meta(p, q_lens, lens)
            kn, vn = new_kv(p, q_lens, lens)
            want = ref.extend(qx, kn, vn, p.k_cache, p.v_cache, meta, scale)
            got = kernels.paged_extend(qx, p.k_cache, p.v_cache, p.tables,
                                       meta.prefill_cu_seqlens_q, p.context_lens, scale)
            errs[f"extend bs={bs} H={heads} kv={kv}"] = rel_err(got, want)
            for name, err in errs.items():
                ok &= err <= tol
                print(f"{name:<44} {err:>12.2e}{'' if err <= tol else '  FAIL'}")
    return ok


# ----------------------------------------------------------------------------------------------
# Timing (CUDA only)
# ----------------------------------------------------------------------------------------------
def copy_bandwidth(device: str = "cuda") -> float:
    """Bytes/s of a large device-to-device copy: the practical ceiling for a streaming kernel."""
    import triton.testing

    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)        # read + write


def timed(fn) -> float | None:
    """Median microseconds of ``fn``, or None if it runs out of memory."""
    import triton.testing

    try:
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def bench_case(batch: int, ctx: int, bs: int, copy_bw: float, device: str = "cuda") -> list[dict]:
    """All rows for one (batch, context, block size) configuration."""
    from ..layers.attention.triton import kernels

    dtype, elt, scale = torch.float16, 2, HEAD_DIM ** -0.5
    torch.manual_seed(0)
    p = make_paged([ctx] * batch, bs, KV_HEADS, HEAD_DIM, dtype, device)
    k, v = contiguous_kv(p, ctx)
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * elt
    ref = TorchAttention()
    rows = []

    def row(op: str, impl: str, us: float | None, nbytes: int, **extra) -> None:
        bw = nbytes / (us * 1e-6) if us else None
        rows.append(dict(op=op, impl=impl, batch=batch, ctx=ctx, block_size=bs, us=us,
                         gbps=bw / 1e9 if bw else None, frac_copy=bw / copy_bw if bw else None,
                         **extra))

    # decode: one query per sequence over the whole context
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device=device)
    nbytes = kv_bytes + 2 * q.numel() * elt
    auto = kernels.choose_num_splits(batch * KV_HEADS, p.tables.shape[1] * bs, q.device)
    forced = max(2, auto)
    row("decode", "triton", timed(lambda: kernels.paged_decode(
        q, p.k_cache, p.v_cache, p.tables, p.context_lens, scale, num_splits=1)), nbytes)
    row("decode", f"triton-split{forced}", timed(lambda: kernels.paged_decode(
        q, p.k_cache, p.v_cache, p.tables, p.context_lens, scale, num_splits=forced)), nbytes,
        auto_splits=auto)
    row("decode", "torch-paged", timed(lambda: ref.decode(
        q, p.k_cache, p.v_cache, p.tables, p.context_lens, scale)), nbytes)
    row("decode", "sdpa-contig", timed(lambda: F.scaled_dot_product_attention(
        q[:, :, None], k, v, scale=scale, enable_gqa=True)), nbytes)

    # extend: a chunk of new tokens per sequence after a cached prefix (chunked prefill)
    qlen = min(ctx, EXTEND_CHUNK)
    if batch * qlen <= MAX_EXTEND_TOKENS:
        from torch.nn.attention.bias import causal_lower_right

        qx = torch.randn(batch * qlen, HEADS, HEAD_DIM, dtype=dtype, device=device)
        meta = extend_meta(p, [qlen] * batch, [ctx] * batch)
        kn, vn = new_kv(p, [qlen] * batch, [ctx] * batch)
        nbytes = kv_bytes + 2 * qx.numel() * elt
        flops = 4 * batch * HEADS * HEAD_DIM * qlen * (ctx - qlen / 2)   # QK^T and PV, causal
        q4 = qx.view(batch, qlen, HEADS, HEAD_DIM).transpose(1, 2)
        mask = causal_lower_right(qlen, ctx)
        for impl, fn in (
                ("triton", lambda: kernels.paged_extend(
                    qx, p.k_cache, p.v_cache, p.tables, meta.prefill_cu_seqlens_q,
                    p.context_lens, scale, max_q_len=qlen)),
                ("torch-paged", lambda: ref.extend(qx, kn, vn, p.k_cache, p.v_cache, meta, scale)),
                ("sdpa-contig", lambda: F.scaled_dot_product_attention(
                    q4, k, v, attn_mask=mask, scale=scale, enable_gqa=True))):
            us = timed(fn)
            row("extend", impl, us, nbytes, tflops=flops / (us * 1e-6) / 1e12 if us else None)

    # store_kv: the K/V of the extend chunk (or one token per sequence for a decode step)
    T = batch * qlen if batch * qlen <= MAX_EXTEND_TOKENS else batch
    kn = torch.randn(T, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    vn = torch.randn_like(kn)
    slots = torch.randperm(p.k_cache.shape[0] * bs, device=device)[:T]
    nbytes = 4 * kn.numel() * elt + 8 * T
    row("store_kv", "triton", timed(lambda: kernels.store_kv(kn, vn, p.k_cache, p.v_cache, slots)),
        nbytes, tokens=T)
    row("store_kv", "torch", timed(lambda: ref.write_kv(kn, vn, p.k_cache, p.v_cache, slots)),
        nbytes, tokens=T)
    del p, k, v
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict]) -> None:
    fmt = "{:<9} {:<15} {:>5} {:>6} {:>3} {:>11} {:>8} {:>6} {:>7}"
    print(fmt.format("op", "impl", "batch", "ctx", "bs", "us", "GB/s", "%copy", "TFLOP/s"))
    for r in rows:
        f = (lambda x, spec: "oom" if x is None else format(x, spec))
        print(fmt.format(r["op"], r["impl"], r["batch"], r["ctx"], r["block_size"],
                         f(r["us"], ".1f"), f(r["gbps"], ".0f"),
                         "" if r["frac_copy"] is None else format(100 * r["frac_copy"], ".0f"),
                         f(r["tflops"], ".1f") if "tflops" in r else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller sweep")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--dtype", default="float32",
                    help="CPU: query and pool dtypes, comma-separated (float32, bfloat16)")
    ap.add_argument("--layers", type=int, default=1,
                    help="CPU: cycle through this many pools (30: a step's, read from memory)")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads (default 1)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
        print(f"On the CPU: decode attention per layer, SmolLM2's shape, {args.threads} "
              f"thread(s), {args.layers} pool(s) in turn; reading memory reaches "
              f"{read_bandwidth_gbps():.1f} GB/s here\n")
        rows = []
        for name in args.dtype.split(","):
            print(f"{name}:")
            part = cpu_decode_rows(contexts=(155,) if args.quick else (155, 1024),
                                   dtype=getattr(torch, name), layers=args.layers,
                                   repeats=5 if args.layers > 1 else 20)
            print_rows(part)
            rows += part
        ok = True
        if triton_available():
            print("\nTriton timings need a CUDA GPU (here its kernels would run in the interpreter);"
                  "\nrunning a correctness sweep against TorchAttention through the interpreter.\n")
            ok = correctness_sweep(args.quick, "cpu")
            print("\nall cases pass" if ok else "\nSOME CASES FAILED")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"device": "cpu", "correct": ok, "rows": rows}, fh, indent=1)
        return 0 if ok else 1
    if not triton_available():
        print("triton is not installed: nothing to run on the GPU")
        return 1

    print(f"device: {torch.cuda.get_device_name()}\ncorrectness (fp32, through the kernels):")
    if not correctness_sweep(True, "cuda"):
        print("correctness check FAILED: not timing")
        return 1
    bw = copy_bandwidth()
    print(f"\ncopy bandwidth: {bw / 1e9:.0f} GB/s; layer shape H={HEADS} kv={KV_HEADS} "
          f"D={HEAD_DIM} fp16\n")
    batches = (1, 32) if args.quick else (1, 8, 32, 128)
    contexts = (512, 2048) if args.quick else (128, 512, 2048, 8192)
    block_sizes = (16,) if args.quick else (16, 32)
    rows = []
    for bs in block_sizes:
        for batch in batches:
            for ctx in contexts:
                print(f"  timing batch={batch} ctx={ctx} block_size={bs}", flush=True)
                rows += bench_case(batch, ctx, bs, bw)
    print()
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": bw / 1e9,
                       "shape": dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                     dtype="float16"), "rows": rows}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
