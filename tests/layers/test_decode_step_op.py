"""Rung 14's attention operator (``minillm::decode_step_attention``, layers/attention/csrc/
decode_step.h) against what the Python custom op does (rung 14's ops.py: the backend's
``write_kv`` then ``decode``): the same new K/V rows in the same slots, the same outputs, zeros in
the rows that pad the batch to its bucket; no context, or a context that does not fit, is an
error and writes nothing."""
from __future__ import annotations

import threading

import pytest
import torch

from minillm.layers.attention import cpp as cpu_attention
from minillm.layers.attention.cpp import CppAttention, cpp_available

pytestmark = pytest.mark.skipif(not cpp_available(), reason="the C++ kernel cannot be built here: "
                                f"{cpu_attention.kernel_error()}")

LAYERS, BLOCKS, BS, H, KVH, D = 3, 12, 4, 6, 2, 16


def pools(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BLOCKS, BS, KVH, D, generator=g).to(dtype),
             torch.randn(BLOCKS, BS, KVH, D, generator=g).to(dtype)) for _ in range(LAYERS)]


def step(rows, seed=1):
    """Block tables of distinct shuffled blocks, lengths 1..9, each row's new token last."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 3 * BS, (rows,), generator=g, dtype=torch.int32)
    blocks = torch.randperm(BLOCKS, generator=g)[:rows * 3].view(rows, 3).to(torch.int32)
    slots = torch.tensor([int(blocks[r, (n - 1) // BS]) * BS + (n - 1) % BS
                          for r, n in enumerate(lens.tolist())])
    return slots, blocks, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,bucket", [(1, 1), (3, 3), (3, 8)])
def test_the_operator_is_write_kv_then_decode(dtype, rows, bucket):
    backend = CppAttention()
    slots, tables, lens = step(rows, seed=rows)
    g = torch.Generator().manual_seed(bucket)
    q, k, v = (torch.randn(bucket, n, D, generator=g).to(dtype) for n in (H, KVH, KVH))
    mine, ref = pools(dtype), pools(dtype)
    got = operator_against_eager(backend, mine, ref, (q, k, v), (slots, tables, lens), rows)
    for layer, (kc, vc) in enumerate(ref):
        assert torch.equal(mine[layer][0], kc) and torch.equal(mine[layer][1], vc)
        assert got[layer].dtype == dtype and got[layer].shape == q.shape


def operator_against_eager(backend, mine, ref, qkv, meta, rows):
    """Every layer's operator output on pools ``mine`` inside a step context, checked against the
    backend's eager ``write_kv`` then ``decode`` on pools ``ref`` (padding rows zeros). Returns
    the operator's outputs; ``ref`` holds the eagerly written pools after."""
    q, k, v = qkv
    slots, tables, lens = meta
    with backend.step_context(mine, slots, tables, lens, rows, 0.25):
        got = [torch.ops.minillm.decode_step_attention(q, k, v, layer) for layer in range(LAYERS)]
    for layer, (kc, vc) in enumerate(ref):
        backend.write_kv(k[:rows], v[:rows], kc, vc, slots)
        want = backend.decode(q[:rows], kc, vc, tables, lens, 0.25)
        assert torch.equal(got[layer][:rows], want), layer
        assert not got[layer][rows:].any(), "padding rows are zeros"
    return got


def test_no_context_or_one_that_does_not_fit_is_an_error():
    backend = CppAttention()
    slots, tables, lens = step(2)
    q, k, v = torch.randn(2, H, D), torch.randn(2, KVH, D), torch.randn(2, KVH, D)
    with pytest.raises(RuntimeError, match="outside a compiled decode step"):
        torch.ops.minillm.decode_step_attention(q, k, v, 0)
    caches = pools(torch.float32)
    before = [(kc.clone(), vc.clone()) for kc, vc in caches]
    with backend.step_context(caches, slots, tables, lens, 2, 1.0):
        with pytest.raises(RuntimeError, match="layer 3 of a model with 3"):
            torch.ops.minillm.decode_step_attention(q, k, v, LAYERS)
        with pytest.raises(RuntimeError, match="do not fit a pool"):
            torch.ops.minillm.decode_step_attention(q, k.double(), v.double(), 0)
        with pytest.raises(RuntimeError, match="rows for a step of 2"):
            torch.ops.minillm.decode_step_attention(q[:1], k[:1], v[:1], 0)
    bad = slots.clone()
    bad[0] = BLOCKS * BS
    with backend.step_context(caches, bad, tables, lens, 2, 1.0):
        with pytest.raises(RuntimeError, match=f"slot {BLOCKS * BS} of row 0 is not in the pool"):
            torch.ops.minillm.decode_step_attention(q, k, v, 0)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(caches, before))
    with pytest.raises(RuntimeError, match="2 int64 slots"):
        with backend.step_context(caches, slots[:1], tables, lens, 2, 1.0):
            pass
    with pytest.raises(RuntimeError, match="outside a compiled decode step"):
        torch.ops.minillm.decode_step_attention(q, k, v, 0)     # the context ended with its block


def test_the_context_is_the_threads_own():
    """Rung 12 runs forwards on a worker thread: a context set on one thread is not another's."""
    backend = CppAttention()
    slots, tables, lens = step(1)
    q, k, v = torch.randn(1, H, D), torch.randn(1, KVH, D), torch.randn(1, KVH, D)
    seen = []

    def other():
        try:
            torch.ops.minillm.decode_step_attention(q, k, v, 0)
            seen.append("ran")
        except RuntimeError as e:
            seen.append(str(e))

    with backend.step_context(pools(torch.float32), slots, tables, lens, 1, 1.0):
        torch.ops.minillm.decode_step_attention(q, k, v, 0)
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(seen) == 1 and "outside a compiled decode step" in seen[0]


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows,bucket", [(1, 1), (3, 8)])
def test_a_pool_of_16_bit_casts_is_served_as_the_eager_path_serves_it(fmt, rows, bucket):
    """An fp32 model on rung 9's 16-bit pool: the operator casts the new rows as the pool's own
    write does and reads the pool's storage; outputs and pools equal the eager path's."""
    from minillm.layers.kv_quant import QuantizedPool, get_format
    backend = CppAttention()
    slots, tables, lens = step(rows, seed=rows + 5)
    g = torch.Generator().manual_seed(bucket + 5)
    q, k, v = (torch.randn(bucket, n, D, generator=g) for n in (H, KVH, KVH))

    def narrow():
        return [tuple(QuantizedPool(t.to(get_format(fmt).storage), None, get_format(fmt),
                                    torch.float32) for t in pair) for pair in pools(torch.float32)]
    mine, ref = narrow(), narrow()
    assert backend.serves_step(mine)
    operator_against_eager(backend, mine, ref, (q, k, v), (slots, tables, lens), rows)
    for layer, (kc, vc) in enumerate(ref):
        assert torch.equal(mine[layer][0].data, kc.data) and torch.equal(mine[layer][1].data,
                                                                           vc.data)


def test_serves_plain_cpu_pools_and_16_bit_casts_only():
    from minillm.layers.kv_quant import QuantizedPool, get_format
    backend = CppAttention()
    assert backend.serves_step(pools(torch.float32)) and backend.serves_step(pools(torch.bfloat16))
    q = QuantizedPool.zeros((BLOCKS, BS, KVH, D), get_format("int8"), torch.float32,
                            torch.device("cpu"))
    assert not backend.serves_step([(q, q)])
