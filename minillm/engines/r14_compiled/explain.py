"""Where the graph breaks (notebook 14): ``python -m minillm.engines.r14_compiled.explain``.

``torch._dynamo.explain`` traces a function the way ``torch.compile`` would (no code generated)
and counts the graphs and the breaks between them. Traced are one decode step of two rows:

* ``eager forward``: rung 3's ``PagedLlama`` forward as the engine runs it -- the attention
  backend and the fused ops are C++ extension calls (pybind), opaque to the tracer, so each
  ends a graph;
* ``DecodeGraph``: rung 14's module, attention as the custom op (ops.py), the rest torch ops.
"""
from __future__ import annotations

import argparse
import warnings

import torch


def explain(model, rows: int = 2) -> dict[str, dict]:
    """{name: {graphs, breaks, reasons}} for both ways of writing the step."""
    from ...core.runner import ModelRunner
    from ...layers.attention import get_attention_backend
    from .graph import DecodeGraph
    from .ops import StepContext, step_context

    backend = get_attention_backend(None, model.device, model.dtype)
    runner = ModelRunner(model, 8, 16, backend)
    ids = torch.arange(3, 3 + rows)
    pos = torch.zeros(rows, dtype=torch.long)
    meta = _decode_meta(rows)
    out = {}
    torch._dynamo.reset()
    eager = torch._dynamo.explain(lambda i, p: runner.net.final_hidden(runner.forward(i, p, meta)))
    with warnings.catch_warnings():     # dynamo's advice on each pybind call: the breaks say it
        warnings.simplefilter("ignore", UserWarning)
        out["eager forward"] = _summary(eager(ids, pos))
    graph = DecodeGraph(runner.net)
    ctx = StepContext(rows, runner.pool.caches, backend, meta.slot_mapping,
                      meta.decode_block_tables, meta.decode_context_lens, runner.net.scale,
                      graph.linears, linear_table=graph.linear_table)
    torch._dynamo.reset()
    with step_context(ctx), torch.inference_mode():
        out["DecodeGraph"] = _summary(torch._dynamo.explain(graph)(ids, pos))
    return out


def _decode_meta(rows: int):
    from ...layers.attention.reference import AttentionMetadata
    tables = torch.arange(rows, dtype=torch.int32)[:, None]
    return AttentionMetadata(
        slot_mapping=torch.arange(rows) * 16, num_decode=rows, decode_block_tables=tables,
        decode_context_lens=torch.ones(rows, dtype=torch.int32),
        prefill_block_tables=torch.empty(0, 0, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.empty(0, dtype=torch.int32), prefill_q_lens=[],
        prefill_ctx_lens=[])


def _summary(e) -> dict:
    reasons = sorted({str(b.reason).splitlines()[0][:100] for b in e.break_reasons})
    return {"graphs": e.graph_count, "breaks": e.graph_break_count, "ops": e.op_count,
            "reasons": reasons}


def main(argv: list[str] | None = None) -> int:
    from ...models import load_model
    p = argparse.ArgumentParser(prog="python -m minillm.engines.r14_compiled.explain",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    args = p.parse_args(argv)
    model = load_model(args.model, dtype=torch.float32)
    for name, s in explain(model).items():
        print(f"{name}: {s['graphs']} graphs, {s['breaks']} breaks, {s['ops']} ops")
        for r in s["reasons"]:
            print(f"    {r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
