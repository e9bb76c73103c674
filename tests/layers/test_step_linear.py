"""Rung 14's C++ linear operator (``minillm::step_linear``, engines/r14_compiled/csrc/
step_linear.cpp): a product on oneDNN's packed weight that a compiled graph calls with no Python
around it. Against the eager ``Linear`` (the same oneDNN call from Python) with and without bias
and residual, in fp32 and bf16; in a traced graph it replaces the Python ``packed_linear`` box;
outside a step, with a released table or an index past the table, it is an error naming what."""
from __future__ import annotations

import threading

import pytest
import torch
from conftest import graph_ops

from minillm.engines.r14_compiled import ops
from minillm.engines.r14_compiled.graph import GraphLinear, onednn_weight
from minillm.engines.r14_compiled.ops import LinearTable, StepContext, step_context
from minillm.layers.gemv import GemvLinear
from minillm.layers.linear import Linear, OneDNNLinear, TorchLinear, onednn_works

pytestmark = [
    pytest.mark.skipif(ops.load_step_linear() is None,
                       reason=f"step_linear cannot be built here: {ops.step_linear_error()}"),
    pytest.mark.skipif(not onednn_works(), reason="no oneDNN on this CPU")]

DTYPES = [torch.float32] + ([torch.bfloat16] if onednn_works(torch.bfloat16) else [])


def layer(out, inp, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    return Linear(w, b, OneDNNLinear())


def table_of(*linears):
    return LinearTable(ops.load_step_linear(), [onednn_weight(lin) for lin in linears],
                       [lin.bias for lin in linears])


def ctx_for(linears, table):
    return StepContext(rows=0, caches=[], backend=None, slot_mapping=None, block_tables=None,
                       context_lens=None, scale=1.0, linears=linears, linear_table=table)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_the_operator_is_the_eager_product(dtype, bias, rows):
    lins = [layer(40, 24, dtype, bias, seed=1), layer(24, 40, dtype, bias, seed=2)]
    table = table_of(*lins)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 24, generator=g).to(dtype)
    res = torch.randn(rows, 24, generator=g).to(dtype)
    with table.on_this_thread():
        y = torch.ops.minillm.step_linear(x, None, 0, 40)
        z = torch.ops.minillm.step_linear(y, res, 1, 24)
    # the same oneDNN call as the eager kernel: the same numbers, bit for bit
    assert torch.equal(y, lins[0](x)) and torch.equal(z, lins[1](lins[0](x), residual=res))


@pytest.mark.parametrize("kernel", ["onednn", "gemv over onednn", "torch"])
def test_a_compiled_graph_calls_it_where_the_weight_is_packed(kernel):
    """A packed oneDNN weight (the engine's default on a CPU, or gemv's many-row base) is a
    ``step_linear`` node; a kernel the tracer sees through stays inline (no box at all)."""
    k = {"onednn": OneDNNLinear(), "gemv over onednn": GemvLinear(OneDNNLinear()),
         "torch": TorchLinear()}[kernel]
    g = torch.Generator().manual_seed(3)
    lin = Linear(torch.randn(48, 64, generator=g), torch.randn(48, generator=g), k)
    linears = []
    node = GraphLinear(lin, linears)
    x = torch.randn(16, 64, generator=g)           # more rows than gemv streams
    table = table_of(*linears) if linears else None
    with step_context(ctx_for(linears, table)):
        seen = graph_ops(node, x)
        torch.testing.assert_close(torch.compile(node, fullgraph=True)(x), lin(x),
                                   rtol=1e-5, atol=1e-5)
    if kernel == "torch":
        assert not any("step_linear" in o or "packed_linear" in o for o in seen), seen
    else:
        assert any("minillm.step_linear" in o for o in seen), seen
        assert not any("packed_linear" in o for o in seen), seen


def test_errors_name_what_is_missing():
    lin = layer(8, 8, torch.float32)
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="outside a compiled decode step"):
        torch.ops.minillm.step_linear(x, None, 0, 8)
    table = table_of(lin)
    with table.on_this_thread():
        with pytest.raises(RuntimeError, match="linear 5 of a table of 1"):
            torch.ops.minillm.step_linear(x, None, 5, 8)
        with pytest.raises(RuntimeError, match="gave 8 features, the graph expected 9"):
            torch.ops.minillm.step_linear(x, None, 0, 9)
    with pytest.raises(RuntimeError, match="outside a compiled decode step"):   # cleared after
        torch.ops.minillm.step_linear(x, None, 0, 8)
    module, handle = table.module, table.handle
    del table                                      # released with its owner
    with pytest.raises(RuntimeError, match=f"no table of packed weights {handle}"):
        module.set_linears(handle)


def test_each_thread_reads_its_own_table():
    """Rung 12 steps on a worker thread: two threads, two tables, each sees its own weights."""
    lins = [layer(16, 16, torch.float32, seed=s) for s in (10, 11)]
    tables = [table_of(lin) for lin in lins]
    x = torch.randn(4, 16)
    got, barrier = {}, threading.Barrier(2)

    def run(i):
        with tables[i].on_this_thread():
            barrier.wait()
            got[i] = [torch.ops.minillm.step_linear(x, None, 0, 16) for _ in range(50)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i, lin in enumerate(lins):
        assert all(torch.equal(y, lin(x)) for y in got[i])
