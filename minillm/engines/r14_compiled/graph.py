"""The decode forward as one ``nn.Module`` of plain tensor ops: what ``torch.compile`` traces.

The same math as ``PagedLlama.forward_layers`` (core/model.py) for a step of one-token decodes,
written for the compiler: the weights are the module's buffers (inputs of the graph, so one
compiled graph serves any weights of these shapes and inductor's disk cache can hold it); RMSNorm, RoPE and SiLU are torch ops (``EagerOps``), which inductor fuses into
C++ loops of its own -- rung 4 wrote those loops by hand (``layers/csrc/fused_ops.cpp``); the
attention is the one custom op (ops.py). The logits of every row come out in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...layers.fused import EagerOps
from ...layers import gemv
from ...layers.gemv import MAX_ROWS, GemvLinear, StreamedLinear
from ...layers.linear import Linear, OneDNNLinear
from ...layers.quant import Int8Linear, int8_path, int8_path_with_kernel
from ...layers.attention import cpp  # noqa: F401  (declares minillm::decode_step_attention)
from . import ops  # noqa: F401  (registers torch.ops.minillm.decode_attention)


class GraphLinear(nn.Module):
    """One ``Linear`` in the graph. A kernel the compiler can trace computes it inline on the
    layer's tensors, held as buffers (``torch``, ``int8``'s torch paths, ``w8a8``); one it cannot
    (``traceable = False``: oneDNN's opaque packed copy) is the ``packed_linear`` op, which finds
    the layer by its index in ``linears`` (the step's context carries that list, ops.py). The
    streamed kernels (layers/gemv.py) are both: the ``minillm::gemv`` operator on their plain
    tensors for a bucket of up to ``MAX_ROWS`` rows, and above it their many-row kernel --
    ``packed_linear`` for oneDNN's, inline for ``tiled``'s (layers/tiled.py: plain panels)."""

    def __init__(self, lin: Linear, linears: list):
        super().__init__()
        self.index, self.out_features, self.native = None, lin.out_features, False
        # the operator exists once its extension is loaded: eager calls load it on their first
        # few-row product, but a process's first step may be a compiled one (a one-token prompt)
        self.streamed = isinstance(lin.kernel, StreamedLinear) and gemv.load() is not None
        if self.streamed:
            # up to MAX_ROWS rows: the gemv operator on these buffers, no Python per product
            self.kernel = lin.kernel
            weight, scale = lin.kernel.stream_tensors(lin.packed)
            self.register_buffer("w", weight, persistent=False)
            self.register_buffer("scale", scale, persistent=False)
            self.register_buffer("bias", lin.bias, persistent=False)
        many, packed = lin.kernel, lin.packed       # what computes more than MAX_ROWS rows
        if isinstance(many, GemvLinear) and many.base.traceable:
            many, packed = many.base, packed[1]
        if not many.traceable:
            self.index = len(linears)
            linears.append(lin)
            # oneDNN's packed copy: the C++ operator where it built, else the Python op
            self.native = onednn_weight(lin) is not None and ops.load_step_linear() is not None
            return
        self.many = many
        # int8's path depends on the CPU (asked here: the question does not trace) and on the
        # rows and dtype (fixed per bucket while tracing, below)
        self.int8_kernel = (isinstance(many, Int8Linear) and many.path is None
                            and int8_path(lin.weight.device) == "int8pack")
        self.parts = len(packed) if isinstance(packed, tuple) else 0
        for i, t in enumerate(packed if self.parts else (packed,)):
            self.register_buffer(f"p{i}", t, persistent=False)
        self.register_buffer("bias", lin.bias, persistent=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # the shape and dtype are the bucket's, fixed while tracing: one branch per graph. In the
        # dynamic graph the row count is a symbol: ``statically_known_true`` takes the branch
        # only where it holds for every row count of its range, and adds no guard (a guard on
        # the symbol would contradict the range the runner marked, runner.py)
        if (self.streamed and statically_known_true(x.shape[0] <= MAX_ROWS)
                and x.dtype in self.kernel.stream_dtypes):
            return self.kernel.stream(x, (self.w, self.scale), self.bias, residual)
        if self.index is not None and self.native:
            return torch.ops.minillm.step_linear(x, residual, self.index, self.out_features)
        if self.index is not None:
            return torch.ops.minillm.packed_linear(x, residual, self.index, self.out_features)
        packed = tuple(getattr(self, f"p{i}") for i in range(self.parts)) if self.parts else \
            self.p0
        kernel = self.many
        if isinstance(kernel, Int8Linear) and kernel.path is None:
            kernel = Int8Linear(int8_path_with_kernel(x.dtype, x.shape[0]) if self.int8_kernel
                                else "dequant")
        return kernel(x, packed, self.bias, residual)


def onednn_weight(lin: Linear) -> torch.Tensor | None:
    """oneDNN's packed copy of ``lin``'s weight where its many-row products use one, else None."""
    kernel, packed = lin.kernel, lin.packed
    if isinstance(kernel, GemvLinear):
        kernel, packed = kernel.base, packed[1]
    return packed if isinstance(kernel, OneDNNLinear) else None


class DecodeGraph(nn.Module):
    """``forward(ids [B], positions [B]) -> logits [B, vocab]`` (fp32) over ``net``'s weights;
    the K/V pool is reached by the attention op through the step's context (ops.py): the C++
    backend's operator where ``native`` (ops.py's docstring), else the Python custom op."""

    def __init__(self, net, native: bool = False):
        super().__init__()
        self.eps = net.eps
        self.linears: list[Linear] = []     # the packed ones, for the step's context (ops.py)
        for name in ("embed", "final_norm", "cos", "sin"):
            self.register_buffer(name, getattr(net, name), persistent=False)
        self.lm_head = GraphLinear(net.lm_head, self.linears)
        self.layers = nn.ModuleList(DecodeLayer(w, i, net, self.linears, native)
                                    for i, w in enumerate(net.layers))
        # the packed weights step_linear reads, registered once (ops.LinearTable)
        module = ops.load_step_linear()
        self.linear_table = ops.LinearTable(
            module, [onednn_weight(lin) for lin in self.linears],
            [lin.bias for lin in self.linears]) if module and self.linears else None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.lm_head(EagerOps.rms_norm(h, self.final_norm, self.eps)).float()


class DecodeLayer(nn.Module):
    def __init__(self, w, index: int, net, linears: list, native: bool):
        super().__init__()
        self.index, self.eps = index, net.eps
        self.attention = (torch.ops.minillm.decode_step_attention if native
                          else torch.ops.minillm.decode_attention)
        self.H, self.KVH, self.D = net.num_heads, net.num_kv_heads, net.head_dim
        self.register_buffer("input_norm", w.input_norm, persistent=False)
        self.register_buffer("post_norm", w.post_norm, persistent=False)
        self.qkv, self.o = GraphLinear(w.qkv, linears), GraphLinear(w.o, linears)
        self.gate_up, self.down = GraphLinear(w.gate_up, linears), GraphLinear(w.down, linears)

    def forward(self, h, cos, sin):
        H, KVH, D = self.H, self.KVH, self.D
        qkv = self.qkv(EagerOps.rms_norm(h, self.input_norm, self.eps))
        q, k = EagerOps.rope(qkv, cos, sin, H, KVH)
        v = qkv[:, (H + KVH) * D:].view(-1, KVH, D)
        attn = self.attention(q, k, v, self.index)
        h = self.o(attn.reshape(-1, H * D), residual=h)
        x = EagerOps.rms_norm(h, self.post_norm, self.eps)
        return self.down(EagerOps.silu_mul(self.gate_up(x)), residual=h)


__all__ = ["DecodeGraph", "GraphLinear", "onednn_weight"]
