"""Paged attention as one custom op, so that ``torch.compile`` traces the decode step whole.

The attention kernels (``layers/attention/``: a C++ extension, or the torch reference with its
data-dependent lengths) are opaque to the compiler: called from the traced function, each one
would end the graph there and start another after it -- 31 graphs for a 30-layer model, Python
between each (``torch._dynamo.explain`` counts them: ``python -m minillm.engines.r14_compiled.
explain``). ``torch.library.custom_op`` gives the compiler a box instead: it sees the op's
output shape (``register_fake``) and calls it as one node of the graph.

The op takes only what flows through the graph -- q, k, v of this step and the layer's index --
and reads everything else from the step's context (``StepContext``, set by the runner before
the compiled call): the KV pool, the attention backend, the real rows' slots, block tables and
lengths. vLLM's ``unified_attention`` does the same (its ``ForwardContext``): the pool is never
a graph input, so the compiler has no multi-GB tensor to guard or copy, and a batch padded to
its bucket writes and reads only its real rows (padded rows' outputs are zeros, thrown away).

Where the attention backend is the C++ kernel on plain pools, the graph calls its operator
instead, ``minillm::decode_step_attention`` (layers/attention/csrc/decode_step.h): the same
context, set once per step in C++, and no Python at all per layer -- the Python op costs
~140 us a layer in a one-row SmolLM2 step, the C++ one ~15 (docs/rungs/14_compiled.md).
"""
from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...layers.attention.cpp import load_extension


@dataclass
class StepContext:
    """What the attention op of every layer reads during one compiled decode step."""

    rows: int                       # the real rows (the batch is padded past them)
    caches: list                    # (k_cache, v_cache) per layer: the runner's pool
    backend: object                 # the engine's attention backend (layers/attention/)
    slot_mapping: torch.Tensor      # [rows] where each row's new K/V go
    block_tables: torch.Tensor      # [rows, max_blocks]
    context_lens: torch.Tensor      # [rows]
    scale: float
    linears: list = field(default_factory=list)    # the Linears packed_linear computes (graph.py)
    native: bool = False            # the graph calls the backend's C++ op (decode_step_attention)
    linear_table: "LinearTable | None" = None   # the packed weights step_linear reads


# per thread: rung 12's ThreadExecutor runs forwards on a worker thread
_local = threading.local()


class step_context:
    """``with step_context(ctx):`` -- the context the op reads, for one compiled call."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx

    def __enter__(self):
        self.prev, _local.ctx = getattr(_local, "ctx", None), self.ctx
        self.stack = ExitStack()
        if self.ctx.native:            # the same context, for the C++ op, on this thread
            c = self.ctx
            self.stack.enter_context(c.backend.step_context(
                c.caches, c.slot_mapping, c.block_tables, c.context_lens, c.rows, c.scale))
        if self.ctx.linear_table is not None:
            self.stack.enter_context(self.ctx.linear_table.on_this_thread())
        return self.ctx

    def __exit__(self, *exc):
        self.stack.close()
        _local.ctx = self.prev


def current() -> StepContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("minillm::decode_attention called outside a compiled decode step "
                           "(no step_context)")
    return ctx


# mutates_args=(): the op writes the pool, but the pool is not among its arguments -- it is
# reached through the context, and only this layer's op touches this layer's pool, after the
# previous layer's output it depends on. So the compiler can neither drop it (its output is
# used) nor move it past another layer's.
@torch.library.custom_op("minillm::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     layer: int) -> torch.Tensor:
    """q [B, H, D], k and v [B, KVH, D] -> [B, H, D]: rows past ``ctx.rows`` are padding."""
    ctx = current()
    n = ctx.rows
    k_cache, v_cache = ctx.caches[layer]
    ctx.backend.write_kv(k[:n].contiguous(), v[:n].contiguous(), k_cache, v_cache,
                         ctx.slot_mapping)
    attn = ctx.backend.decode(q[:n].contiguous(), k_cache, v_cache, ctx.block_tables,
                              ctx.context_lens, ctx.scale)
    if n == q.shape[0]:
        return attn.contiguous()
    out = q.new_zeros(q.shape)
    out[:n] = attn
    return out


@decode_attention.register_fake
def _(q, k, v, layer):
    return q.new_empty(q.shape)       # contiguous, as the real op returns it


# A linear layer whose weight is oneDNN's packed copy (``layers/linear.py``'s ``onednn`` kernel,
# the eager engine's choice on a CPU): that copy is an opaque tensor the tracer cannot look at,
# so the product is a box too, reached by its index in the step's context. Measured at one row
# (docs/rungs/14_compiled.md): the packed product beats the ``mm`` inductor calls on the plain
# weight by more than the host time the compiled step saves.
@torch.library.custom_op("minillm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, residual: torch.Tensor | None, index: int,
                  out_features: int) -> torch.Tensor:
    """``ctx.linears[index](x, residual)``: x [B, in] -> [B, out_features]."""
    return current().linears[index](x, residual)


@packed_linear.register_fake
def _(x, residual, index, out_features):
    return x.new_empty(x.shape[0], out_features)


# The same product with no Python around it: ``minillm::step_linear`` (csrc/step_linear.cpp) finds
# the packed weight in a table the runner registers once (``LinearTable``) and calls oneDNN's
# operator from C++, instead of ~121 calls of the interpreter a step: 16 bf16 rows 28.3-29.0 ms a
# step against 30.4-31.5 through the Python op (docs/rungs/14_compiled.md). Without a C++
# compiler, ``packed_linear`` above serves.
torch.library.define("minillm::step_linear",
                     "(Tensor x, Tensor? residual, int index, int out_features) -> Tensor")


@torch.library.register_fake("minillm::step_linear")
def _(x, residual, index, out_features):
    return x.new_empty(x.shape[0], out_features)


_SOURCE = Path(__file__).with_name("csrc") / "step_linear.cpp"
_state: dict = {}


def load_step_linear():
    """The built ``step_linear`` module, or None (the reason in ``_state["error"]``)."""
    return load_extension(_SOURCE, _state, "rung 14's C++ linear operator (step_linear)",
                          "the Python packed_linear op", stem="minillm_step_linear")


def step_linear_error() -> str | None:
    """Why ``step_linear`` could not be built here, or None."""
    return _state.get("error")


class LinearTable:
    """oneDNN's packed weights of one compiled graph, registered once in ``step_linear``'s table
    (None where a layer's kernel has no packed copy: that layer never calls the operator)."""

    def __init__(self, module, packed: list, biases: list):
        empty = torch.empty(0)
        self.module = module
        self.handle = module.register_linears([p if p is not None else empty for p in packed],
                                              biases)
        weakref.finalize(self, module.release_linears, self.handle)

    def on_this_thread(self):
        """``with table.on_this_thread():`` -- the table this thread's operators read."""
        stack = ExitStack()
        self.module.set_linears(self.handle)
        stack.callback(self.module.clear_linears)
        return stack


__all__ = ["LinearTable", "StepContext", "current", "decode_attention", "load_step_linear",
           "packed_linear", "step_context", "step_linear_error"]
