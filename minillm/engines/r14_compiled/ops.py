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
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch


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


__all__ = ["StepContext", "current", "decode_attention", "packed_linear", "step_context"]
