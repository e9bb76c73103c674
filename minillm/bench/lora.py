"""Rung 13's measurement: what serving adapters costs (notebook 13_multi_lora).

The same requests three ways, each on a warm engine:
* ``base``: every request on the base model (no adapter): the floor;
* ``mixed``: each request with its own adapter, K adapters in one batch (``max_loras=K``);
* ``separate``: each adapter's requests in a run of their own, one adapter after another (what
  serving one merged model per adapter, on one device, one at a time, amounts to);
and the swap cost: copying one adapter from host memory into a device slot.

    python -m minillm.bench.lora --model tiny-llama            # seconds
    python -m minillm.bench.lora                                # SmolLM2, about a minute
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ..engines.r13_lora.adapter import TARGETS, LoRARequest
from ..engines.r13_lora.config import LORA_KERNELS
from ..engines.r13_lora.peft_files import save_random_adapter
from ..engines.r13_lora.slots import LoRASlots
from ..lab.reference import random_prompts


def timed_generate(llm, prompts, params, loras) -> tuple[float, int]:
    """(seconds, output tokens) of one run."""
    t = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    return time.perf_counter() - t, sum(len(o.token_ids) for o in outs)


def best(a: tuple[float, int], b: tuple[float, int] | None) -> tuple[float, int]:
    return a if b is None or a[0] < b[0] else b


def measure(model_name: str, k: int, per_adapter: int, max_tokens: int, rank: int,
            kernel: str, rounds: int = 3) -> dict:
    from .. import LLM, SamplingParams, load_model

    model = load_model(model_name, dtype=torch.float32)
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    loras = [LoRARequest(f"a{i}", str(save_random_adapter(root / f"a{i}", model.hf_model, r=rank,
                                                          targets=TARGETS, seed=i)))
             for i in range(k)]
    vocab = model.hf_model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in random_prompts(k * per_adapter, seed=0, lo=16, hi=64)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model, engine="paged", enable_lora=True, max_loras=k, max_lora_rank=rank,
              lora_kernel=kernel, max_num_seqs=len(prompts))
    mine = [loras[i % k] for i in range(len(prompts))]
    llm.generate(prompts, params, lora_request=mine)            # warm-up, adapters read
    out: dict = {"base": None, "mixed": None, "separate": None}
    for _ in range(rounds):     # interleaved, best of each: a load that comes and goes hits all
        out["base"] = best(timed_generate(llm, prompts, params, None), out["base"])
        out["mixed"] = best(timed_generate(llm, prompts, params, mine), out["mixed"])
        runs = [timed_generate(llm, prompts[i::k], params, loras[i]) for i in range(k)]
        out["separate"] = best((sum(s for s, _ in runs), sum(n for _, n in runs)),
                               out["separate"])
    adapter = llm.engine.adapters[loras[0].lora_name][1]
    runner = llm.engine.runner
    slots = LoRASlots(runner.shapes, len(runner.net.layers), 1, rank, runner.device, model.dtype)
    t = time.perf_counter()
    slots.acquire(adapter, busy=set())          # one swap-in: host memory -> a device slot
    out["swap_ms"] = (time.perf_counter() - t) * 1000.0
    out["adapter_mib"] = adapter.nbytes / 2 ** 20
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--adapters", type=int, default=4, help="K adapters")
    ap.add_argument("--per-adapter", type=int, default=8, help="requests per adapter")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-kernel", default="sgmv", choices=LORA_KERNELS)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="also write the numbers to this file")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    r = measure(a.model, a.adapters, a.per_adapter, a.max_tokens, a.rank, a.lora_kernel)
    print(f"{a.model}: {a.adapters} adapters of rank {a.rank} on all 7 projections, "
          f"{a.per_adapter} requests each, {a.max_tokens} tokens, kernel {a.lora_kernel}, "
          f"{torch.get_num_threads()} threads")
    base = r["base"][1] / r["base"][0]
    for name in ("base", "mixed", "separate"):
        s, n = r[name]
        print(f"  {name:>8}: {n / s:8.1f} output tok/s  ({s:.2f} s, {base * s / n:.2f}x base time)")
    print(f"  swap-in of one adapter ({r['adapter_mib']:.2f} MiB): {r['swap_ms']:.2f} ms")
    if a.json:
        setting = {k: getattr(a, k) for k in ("model", "adapters", "per_adapter", "max_tokens",
                                              "rank", "lora_kernel")}
        rows = {name: {"seconds": r[name][0], "output_tokens": r[name][1],
                       "output_tok_s": r[name][1] / r[name][0]}
                for name in ("base", "mixed", "separate")}
        Path(a.json).write_text(json.dumps({**setting, "threads": torch.get_num_threads(),
                                            **rows, "swap_ms": r["swap_ms"],
                                            "adapter_mib": r["adapter_mib"]}, indent=2))


if __name__ == "__main__":
    main()
