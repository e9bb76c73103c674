"""The pieces of the benchmark's main table that a run of it and its rounds share
(``offline.run_table``, ``offline_rounds.run_rounds``): which runs it has, one engine alone for
its single stream, the machine's matmul peak, and a row from a run."""
from __future__ import annotations

import torch

from .kv import budget_bytes
from ..engines import options_for
from ..metrics import RunMetrics

WARMS_UP_ITSELF = {"vllm-cpu"}


# --- running one engine ---------------------------------------------------------------------------


def single_stream(model, name: str, items, options: dict, k: int = 4) -> dict:
    """The first ``k`` requests one at a time (as vLLM's row does): output tok/s with no batch to
    hide per-step costs behind, and time to first token."""
    from ..llm import LLM
    from ..workload import to_requests

    llm = LLM(model, engine=name, **options_for(name, options))
    outs = [llm.run(to_requests(llm, [it]), progress=False).outputs[0] for it in items[:k]]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"single_stream_tok_s": tokens / sum(o.latency_s for o in outs),
            "single_stream_ttft_s": [o.ttft_s for o in outs]}


# --- the roofline ---------------------------------------------------------------------------------
def measure_matmul_gflops() -> float:
    """This machine's fp32 matmul peak, measured: the ceiling any engine could reach -- the best
    of torch's ``@`` (MKL on x86) and the engine's default linear kernel (layers/linear.py) on a
    2048^3 product."""
    from ..layers.linear import TorchLinear, get_linear_kernel, matmul_gflops

    best = get_linear_kernel(None, torch.device("cpu"), torch.float32)
    return max(matmul_gflops(TorchLinear()), matmul_gflops(best))


def model_gflop_per_token(model) -> float:
    """Forward FLOPs per token ~ 2 x (matmul weights): every weight is one multiply-add."""
    params = sum(p.numel() for n, p in model.hf_model.named_parameters() if "embed_tokens" not in n)
    if model.config.tie_word_embeddings:   # the LM head reuses the embedding matrix
        params += model.hf_model.get_output_embeddings().weight.numel()
    return 2 * params / 1e9


def roofline_fraction(m: RunMetrics, gflop_per_token: float, peak_gflops: float) -> float:
    """Achieved FLOP/s over the step's real work (prompt tokens computed + output tokens)."""
    work = (m.prefill_tokens_computed + m.output_tokens) * gflop_per_token
    return work / m.duration_s / peak_gflops if m.duration_s else 0.0


def kv_budget_options(model, items, options: dict) -> dict:
    """Paged at the *KV memory* the contiguous engines need, instead of at their batch cap.

    A padded engine serving ``max_batch`` rows must be able to hold each row at its longest
    (prompt + max_tokens). Give the paged engine exactly those bytes and no row cap: it fits as
    many requests as the tokens really need. This is the paper's argument — memory, not compute,
    limits the batch — made into one row of the table."""
    rows = options.get("max_num_seqs", 64)
    return {**options, "kv_cache_bytes": budget_bytes(model, items, rows), "max_num_seqs": 4 * rows}


def table_runs(model, engines: list[str], items, options: dict) -> list[tuple[str, dict]]:
    """(label, options) per run; paged is followed by ``paged-kv-budget`` (kv_budget_options)."""
    runs = [(name, options) for name in engines]
    if "paged" in engines:
        runs.insert(engines.index("paged") + 1, ("paged-kv-budget", kv_budget_options(model, items, options)))
    return runs


def workload_of(name: str, items, naive_items):
    """Engines that serve one request at a time (naive) run the short list."""
    from ..engines import REGISTRY
    return naive_items if name in REGISTRY and REGISTRY[name].serves_one_at_a_time else items


def engine_of(label: str) -> str:   # paged-kv-budget runs the paged engine
    return "paged" if label == "paged-kv-budget" else label


def table_row(label: str, res, per_tok: float, peak: float) -> dict:
    """One row of the table from one engine's ``RunResult``."""
    row = res.metrics.as_dict()
    row["engine"] = label
    row["single_stream_tok_s"] = row["extra"].get("single_stream_tok_s")
    row["roofline"] = roofline_fraction(res.metrics, per_tok, peak)
    row["matmul_peak_gflops"] = peak
    return row


def finish_table(rows: list[dict], outputs: dict) -> list[dict]:
    """vLLM's agreement with paged, and every row's speed-up over naive."""
    if "vllm-cpu" in outputs and "paged" in outputs:
        from .vllm_peer import token_agreement
        agreement = token_agreement(outputs["paged"], outputs["vllm-cpu"])
        print(f"  vLLM vs paged greedy tokens: {agreement}")
        vllm_row = next(r for r in rows if r["engine"] == "vllm-cpu")
        vllm_row["agreement_with_paged"] = agreement
        print(f"  vLLM's OpenMP threads bound to cores {vllm_row['extra']['omp_threads_bind']}; "
              f"minillm: {torch.get_num_threads()} torch threads")
    base = next((r["output_tok_s"] for r in rows if r["engine"] == "naive"), None)
    for r in rows:
        r["speedup_vs_naive"] = r["output_tok_s"] / base if base else float("nan")
    if base:    # naive serves one request at a time: its throughput is its single stream
        next(r for r in rows if r["engine"] == "naive")["single_stream_tok_s"] = base
    return rows
