"""Benchmark workloads: bundled prompts, mixed output lengths, arrivals at once or Poisson.

Real traffic mixes short answers with long ones; that mix is exactly what hurts static batching
(a batch lasts as long as its longest member), so the default length distribution is a mixture:
most requests short, a minority long. Every draw is seeded, so each engine in a benchmark run
gets the same workload.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .request import SamplingParams

PROMPTS_FILE = Path(__file__).parent / "data" / "prompts.jsonl"
# The default mix: everyday chat-sized prompts (32-80 tokens with the chat template). The "long"
# category (350-860 tokens of document + question) is opt-in: one long prompt sets the width of a
# whole padded batch, which is a lesson of its own (see `bench --long-prompts`).
CHAT_MIX = ("chat", "instruction", "reasoning", "code")

# ~256 tokens of shared system prompt, for the prefix-caching benchmark: every request starts
# with the same instructions, as a chat product's requests do.
SHARED_SYSTEM_PROMPT = (
    "You are Atlas, the help-desk assistant of the Northwind Public Library. Follow these rules in "
    "every answer. First, be brief: two or three sentences unless the visitor asks for detail. "
    "Second, be accurate: if you do not know something about the library, say so and suggest the "
    "front desk, which is open from nine in the morning to eight in the evening on weekdays and "
    "from ten to five on weekends. Third, be kind and patient with every visitor, including "
    "children and people who are new to computers. Fourth, never share personal data about other "
    "patrons, staff or borrowing records. Fifth, when recommending books, offer at least one title "
    "that is available in the children's section and one in the adult section if the topic allows "
    "it. Sixth, remind visitors that printing costs ten cents a page, that study rooms can be "
    "booked for two hours at a time, and that laptops may be borrowed for use inside the building "
    "only. Seventh, answer in plain English without jargon, and end with a short offer of further "
    "help. The library has three floors: fiction and the cafe on the ground floor, non-fiction and "
    "study rooms on the first floor, and the local history archive on the second floor."
)


@dataclass
class WorkItem:
    prompt: dict                 # {"messages": [...]} — what LLM.encode accepts
    params: SamplingParams
    arrival_offset_s: float = 0.0


def load_prompts() -> list[dict]:
    with open(PROMPTS_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def output_lengths(n: int, rng: random.Random, short: tuple[int, int] = (8, 48),
                   long: tuple[int, int] = (96, 192), p_long: float = 0.3) -> list[int]:
    """Mixed output lengths: ``p_long`` of requests draw from ``long``, the rest from ``short``."""
    return [rng.randint(*(long if rng.random() < p_long else short)) for _ in range(n)]


def arrival_offsets(n: int, rng: random.Random, rate: float | None) -> list[float]:
    """All at t=0 (``rate`` None), or a Poisson process of ``rate`` requests per second."""
    if not rate:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_workload(num_requests: int, seed: int = 0, rate: float | None = None,
                  short: tuple[int, int] = (8, 48), long: tuple[int, int] = (96, 192),
                  p_long: float = 0.3, shared_prefix: bool = False, n: int = 1,
                  categories: tuple[str, ...] | None = CHAT_MIX) -> list[WorkItem]:
    """``num_requests`` chat requests drawn (with replacement if needed) from the bundled prompts.

    Greedy with ``ignore_eos``, as in vLLM's benchmarks: every engine then produces exactly the
    drawn number of tokens, so throughput numbers compare like with like.
    """
    rng = random.Random(seed)
    pool = [p for p in load_prompts() if categories is None or p["category"] in categories]
    picks = rng.sample(pool, num_requests) if num_requests <= len(pool) else \
        [rng.choice(pool) for _ in range(num_requests)]
    lengths = output_lengths(num_requests, rng, short, long, p_long)
    arrivals = arrival_offsets(num_requests, rng, rate)
    items = []
    for p, max_tokens, t in zip(picks, lengths, arrivals):
        messages = [m for m in p["messages"] if not shared_prefix or m["role"] != "system"]
        if shared_prefix:
            messages = [{"role": "system", "content": SHARED_SYSTEM_PROMPT}] + messages
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n,
                                temperature=0.8 if n > 1 else 0.0, seed=seed if n > 1 else None)
        items.append(WorkItem({"messages": messages}, params, t))
    return items


def to_requests(llm, items: list[WorkItem]):
    """Fresh ``Request`` objects for one engine run (requests are stateful, never reuse them)."""
    reqs = llm.make_requests([it.prompt for it in items], [it.params for it in items])
    for r, it in zip(reqs, items):
        r.arrival_offset_s = it.arrival_offset_s
    return reqs
