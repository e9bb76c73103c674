"""Decode attention on the CPU, timed per layer in SmolLM2's shape (``python -m
minillm.bench.kernels`` on a machine without CUDA; notebook 04): rung 3's torch reference, the C++
kernel that reads the blocks in place (``layers/attention/csrc``), and SDPA on contiguous K/V; with
the bandwidth reading memory reaches here, which decode attention at large batches is bound by."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.attention.reference import TorchAttention
from .paged_kv import contiguous_kv, make_paged


def cpu_decode_rows(batches=(1, 16, 64, 128, 256), contexts=(155, 1024), repeats: int = 20,
                    dtype: torch.dtype = torch.float32, layers: int = 1) -> list[dict]:
    """On the CPU, one decode layer of SmolLM2's shape (9 heads, 3 KV heads, head_dim 64) in
    ``dtype`` (query and pool): rung 3's torch reference (gather the blocks into a padded copy,
    then SDPA), the C++ kernel that reads the blocks in place, and SDPA on K/V already contiguous
    (no paging at all). ``layers`` > 1 cycles through that many pools, as a step does through its
    layers: then the pool comes from memory, not from the cache a single pool sits in."""
    import time

    from ..layers.attention.cpp import CppAttention

    heads, kvh, d, bs = 9, 3, 64, 16
    ref, cpp = TorchAttention(), CppAttention()
    rows = []
    for ctx in contexts:
        for batch in batches:
            torch.manual_seed(0)
            pools = [make_paged([ctx] * batch, bs, kvh, d, dtype, "cpu") for _ in range(layers)]
            p = pools[0]
            q = torch.randn(batch, heads, d).to(dtype)
            k, v = contiguous_kv(p, ctx)
            nbytes = 2 * batch * ctx * kvh * d * p.k_cache.element_size()

            def each(fn):
                return lambda: [fn(x) for x in pools]
            impls = [("torch-paged", each(lambda x: ref.decode(q, x.k_cache, x.v_cache, x.tables,
                                                               x.context_lens, d ** -0.5))),
                     ("sdpa-contig", lambda: [F.scaled_dot_product_attention(   # (cached)
                         q[:, :, None], k, v, scale=d ** -0.5, enable_gqa=True)
                         for _ in range(layers)])]
            if cpp.kernel is not None:
                impls.insert(1, ("cpp-paged", each(lambda x: cpp.decode(
                    q, x.k_cache, x.v_cache, x.tables, x.context_lens, d ** -0.5))))
            for impl, fn in impls:
                fn()
                t = time.perf_counter()
                for _ in range(repeats):
                    fn()
                us = (time.perf_counter() - t) / repeats / layers * 1e6
                rows.append(dict(op="decode", impl=impl, batch=batch, ctx=ctx, block_size=bs,
                                 us=us, gbps=nbytes / (us * 1e-6) / 1e9, frac_copy=None,
                                 dtype=str(dtype).removeprefix("torch."), layers=layers))
    return rows


def read_bandwidth_gbps(nbytes: int = 256 << 20) -> float:
    """What summing a large tensor reaches here: the memory bandwidth the kernel competes with."""
    import time

    x = torch.ones(nbytes // 4)
    x.sum()
    t = time.perf_counter()
    for _ in range(3):
        x.sum()
    return 3 * nbytes / (time.perf_counter() - t) / 1e9
