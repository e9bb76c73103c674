"""What the sampler's controls cost per step: ``python -m minillm.bench.sampler_controls``.

Times ``sampling.apply_controls`` (penalties, ``min_p``, ``logit_bias``, vectorized
over the batch) on ``--rows`` rows of random fp32 logits over SmolLM2's vocabulary, each row with
a random 200-token prompt and 100-token output as its history, for each control alone and all
together. Prints one JSON line of medians in milliseconds. The logits are random: only the time
is measured (the values are tests/runtime/test_sampler_controls.py's).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ..sampling import apply_controls
from ..sampling_params import SamplingParams

CASES = {"repetition": dict(repetition_penalty=1.2),
         "frequency_presence": dict(frequency_penalty=0.5, presence_penalty=0.3),
         "min_p": dict(min_p=0.05), "logit_bias": dict(logit_bias={5: 1.0, 7: -2.0}),
         "all": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                     min_p=0.05, logit_bias={5: 1.0, 7: -2.0})}


def median_ms(params: SamplingParams, logits: torch.Tensor, histories: list, repeats: int) -> float:
    times = []
    for _ in range(repeats + 5):                   # the first calls warm up
        t = time.perf_counter()
        apply_controls(logits, [params] * len(histories), histories)
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times[5:]), 2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    histories = [([rng.randrange(args.vocab) for _ in range(200)],
                  [rng.randrange(args.vocab) for _ in range(100)]) for _ in range(args.rows)]
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    out = {"rows": args.rows, "vocab": args.vocab, "threads": torch.get_num_threads()}
    for name, fields in CASES.items():
        out[f"{name}_ms"] = median_ms(SamplingParams(temperature=0.8, **fields), logits,
                                      histories, args.repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
