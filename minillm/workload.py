"""Workloads: what the benchmark sends to engines, and what the fragmentation visualizer replays.

Benchmark workloads (``make_workload``): bundled prompts, mixed output lengths, arrivals at once or
Poisson. Real traffic mixes short answers with long ones; that mix is exactly what hurts static
batching (a batch lasts as long as its longest member), so the default length distribution is a
mixture: most requests short, a minority long. Every draw is seeded, so each engine in a benchmark
run gets the same workload.

Visualizer workloads (``WorkloadSpec``, notebook 05): requests reduced to what an allocator sees,
``SimRequest`` (prompt tokens, how many tokens each sample produces, when it arrives); a recorded
engine run becomes ``SimRequest`` s too (``viz/traces.py``).
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


def arrival_offsets(n: int, rng: random.Random, rate: float | None,
                    burst: tuple[int, float] | None = None) -> list[float]:
    """All at t=0 (``rate`` None), or a Poisson process of ``rate`` requests per second;
    ``burst=(k, r)``: a rate step -- after the first ``k`` requests, ``r`` per second."""
    if not rate:
        return [0.0] * n
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(burst[1] if burst and i + 1 >= burst[0] else rate)
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


# Copy-heavy requests (speculative decoding, notebook 06): the answer repeats or edits a passage
# of the prompt, as editing, quoting and "fix this" requests do. Passages are the bundled long
# documents' opening paragraphs; nothing is downloaded.
COPY_TASKS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Quote this passage verbatim, then stop:\n\n{text}",
    "Rewrite this text with every sentence kept as it is, but in one paragraph:\n\n{text}",
    "Copy the text below and put it in double quotes:\n\n{text}",
)


def copy_passages(max_chars: int = 700) -> list[str]:
    """The opening paragraphs (up to ``max_chars``) of each bundled long document."""
    out = []
    for p in load_prompts():
        if p["category"] != "long":
            continue
        text = p["messages"][-1]["content"]
        paras = [x for x in text.split("\n\n")
                 if x.strip() and not x.startswith("Read the following")]   # the task line
        passage = ""
        for para in paras:
            if passage and len(passage) + len(para) > max_chars:
                break
            passage = f"{passage}\n\n{para}" if passage else para
        out.append(passage[:max_chars])
    return out


def make_copy_workload(num_requests: int, seed: int = 0, rate: float | None = None,
                       lengths: tuple[int, int] = (64, 128)) -> list[WorkItem]:
    """``num_requests`` copy-heavy requests: a task from ``COPY_TASKS`` on a bundled passage,
    greedy with ``ignore_eos`` and ``lengths`` output tokens, like ``make_workload``'s."""
    rng = random.Random(seed)
    passages = copy_passages()
    arrivals = arrival_offsets(num_requests, rng, rate)
    items = []
    for t in arrivals:
        content = rng.choice(COPY_TASKS).format(text=rng.choice(passages))
        params = SamplingParams(max_tokens=rng.randint(*lengths), ignore_eos=True)
        items.append(WorkItem({"messages": [{"role": "user", "content": content}]}, params, t))
    return items


def to_requests(llm, items: list[WorkItem]):
    """Fresh ``Request`` objects for one engine run (requests are stateful, never reuse them)."""
    reqs = llm.make_requests([it.prompt for it in items], [it.params for it in items])
    for r, it in zip(reqs, items):
        r.arrival_offset_s = it.arrival_offset_s
    return reqs


# --- the fragmentation visualizer's workloads (notebook 05) ------------------------------------
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
    beam_width: int = 1                  # > 1: a beam search, replayed from ``beam_choices``
    beam_choices: list | None = None     # each step's ``BeamChoice.to_list()`` (traces only)

    def __post_init__(self):
        if not self.output_lens or min(self.output_lens) < 1:
            raise ValueError(f"{self.request_id}: every sample must produce >= 1 token")
        self.max_tokens = max(self.max_tokens, max(self.output_lens))
        if self.beam_width > 1 and self.beam_choices is None:
            raise ValueError(f"{self.request_id}: a beam search replays its recorded choices")

    @property
    def n(self) -> int:
        """Parallel samples (a beam search's final beams are not samples: 1)."""
        return 1 if self.beam_width > 1 else len(self.output_lens)

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
