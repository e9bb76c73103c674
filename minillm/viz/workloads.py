"""What the fragmentation visualizer replays: requests reduced to lengths and arrival steps.

``SimRequest`` is one request as an allocator sees it (prompt tokens, how many tokens each sample
produces, when it arrives); ``WorkloadSpec`` draws a synthetic workload of them from the knobs of
notebook 05 (``05_fragmentation_visualizer``). A recorded engine run becomes ``SimRequest`` s too
(``traces.py``). Nothing here knows about memory: ``allocators.py`` serves these requests.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

LENGTH_DISTS = ("uniform", "long-tail", "bimodal")
DUMMY_TOKEN = -1      # what the fake model "samples"; never a real token id, so never a cache hit


@dataclass
class SimRequest:
    """One request as the allocators see it: token ids in, how many tokens come out, when."""

    request_id: str
    prompt_token_ids: list[int]
    output_lens: list[int]               # tokens each of the n samples produces before it stops
    max_tokens: int                      # the cap the client sent (>= every output length)
    arrival_step: int = 0                # added after this many engine steps
    priority: int = 0
    output_token_ids: list[list[int]] | None = None   # recorded tokens (trace), else dummies

    def __post_init__(self):
        if not self.output_lens or min(self.output_lens) < 1:
            raise ValueError(f"{self.request_id}: every sample must produce >= 1 token")
        self.max_tokens = max(self.max_tokens, max(self.output_lens))

    @property
    def n(self) -> int:
        return len(self.output_lens)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def token(self, sample: int, index: int) -> int:
        if self.output_token_ids is not None and index < len(self.output_token_ids[sample]):
            return self.output_token_ids[sample][index]
        return DUMMY_TOKEN


@dataclass
class WorkloadSpec:
    """The knobs of notebook 05. Lengths are drawn per request from ``length_dist`` over the
    closed ranges; arrivals are a Poisson process in engine steps."""

    num_requests: int = 32
    arrival_rate: float | None = 1.0        # requests per engine step; None or 0: all at step 0
    prompt_len: tuple[int, int] = (16, 160)
    output_len: tuple[int, int] = (8, 256)
    length_dist: str = "long-tail"          # uniform | long-tail | bimodal
    max_tokens: int | None = None           # the cap every client sends; default output_len[1]
    shared_prefix: bool = False             # every prompt starts with the same system prompt
    prefix_len: int = 96
    n: int = 1                              # parallel samples per request
    seed: int = 0

    def make(self) -> list[SimRequest]:
        if self.length_dist not in LENGTH_DISTS:
            raise ValueError(f"unknown length_dist {self.length_dist!r}: {', '.join(LENGTH_DISTS)}")
        rng = random.Random(self.seed)
        prefix = [rng.randrange(10, 30000) for _ in range(self.prefix_len if self.shared_prefix else 0)]
        cap = self.max_tokens or self.output_len[1]
        step, out = 0.0, []
        for i in range(self.num_requests):
            plen = draw_length(rng, self.prompt_len, self.length_dist)
            prompt = prefix + [rng.randrange(10, 30000) for _ in range(plen)]
            outs = [min(cap, draw_length(rng, self.output_len, self.length_dist))
                    for _ in range(self.n)]
            out.append(SimRequest(f"r{i}", prompt, outs, cap, int(step)))
            if self.arrival_rate:
                step += rng.expovariate(self.arrival_rate)
        return out


def draw_length(rng: random.Random, bounds: tuple[int, int], dist: str) -> int:
    lo, hi = int(bounds[0]), int(bounds[1])
    lo, hi = max(1, min(lo, hi)), max(1, lo, hi)
    if dist == "uniform":
        return rng.randint(lo, hi)
    if dist == "long-tail":       # most short, a few long: exponential with mean a fifth of the range
        return min(hi, lo + int(rng.expovariate(5.0 / max(1, hi - lo))))
    # bimodal: 70% from the lowest quarter of the range, 30% from the top half
    span = hi - lo
    return rng.randint(lo, lo + span // 4) if rng.random() < 0.7 else rng.randint(lo + span // 2, hi)
