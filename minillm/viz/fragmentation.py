"""The fragmentation visualizer's engine: replay a workload through KV allocators, no model needed.

Memory waste in a KV cache depends only on *who holds which slots when*, not on what the model
computes. So this module runs a workload through three allocators with a fake model step (every
scheduled token is "computed" instantly, every sequence that reaches its end "samples" a token)
and records, per step, how the memory is used. Hundreds of steps take a fraction of a second,
which is what lets notebook 05 re-run everything whenever a slider moves.

The three allocators, all given the same budget of ``budget_slots`` token slots:

* ``max-length``: each request reserves ``max_len`` contiguous slots when it is admitted, the
  longest any request could ever need, because the server cannot know how long the answer will be.
* ``exact``: each request reserves exactly ``prompt + max_tokens`` contiguous slots, first-fit in
  one address space. Smaller reservations, but different sizes: when requests leave, the free
  space is cut into holes, and a newcomer that fits in the total free space may fit in no hole.
* ``paged``: the real ``BlockManager`` and ``Scheduler`` of ``minillm.engines.s3_paged``. Blocks of
  ``block_size`` slots are taken only when the last one is full and can sit anywhere in the pool.

Each step reports (``SimStep``) these kinds of slots, defined once here and used everywhere:

* ``token``: holds the K/V of a computed token;
* ``internal``: allocated, but no token sits there and none is reserved for a known future token:
  the unfilled tail of a sequence's last block (paged), or padding (the padded rectangles of
  steps 0-2). At most ``block_size - 1`` slots per sequence when paged;
* ``reserved``: held for tokens a request may still produce (the contiguous allocators reserve a
  request's whole future up front; much of it is never written);
* ``external``: free, but unusable: slots in free holes too small for the request at the head of
  the waiting queue. Zero when nobody is waiting, and always zero when paged (any free block is as
  good as any other);
* ``waste %`` = (internal + reserved) / allocated = ``1 - token / allocated``, exactly what
  ``KVUsage.waste_fraction`` and the engines' ``RunMetrics.kv_waste_pct`` compute.

``trace_from_run`` turns a real ``PagedEngine`` run into a ``Trace`` (each request's prompt, its
output lengths and the engine step at which it was added); ``replay_trace`` runs it through the
paged allocator and reproduces the engine's per-step ``allocated_slots``/``token_slots`` exactly.
"""
from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..engines.s3_paged.runner import reaching_end, step_order
from ..engines.s3_paged.sequence import Sequence
from ..memory import CACHED, FREE, PADDING, RESERVED, TOKEN, MemorySnapshot
from ..request import Request, RequestError, SamplingParams

ALLOCATORS = ("max-length", "exact", "paged")
ALLOCATOR_LABELS = {"max-length": "max-length reservation", "exact": "exact contiguous",
                    "paged": "paged (BlockManager)"}
LENGTH_DISTS = ("uniform", "long-tail", "bimodal")
DUMMY_TOKEN = -1      # what the fake model "samples"; never a real token id, so never a cache hit


# --- workloads ----------------------------------------------------------------------------------
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


# --- configuration and results ------------------------------------------------------------------
@dataclass
class SimConfig:
    """What every allocator shares: one memory budget and one scheduler's limits."""

    budget_slots: int = 4096                # KV memory in token slots, the same for every allocator
    block_size: int = 16                    # paged only; the pool has budget_slots // block_size blocks
    max_num_batched_tokens: int = 512       # tokens one step may compute (chunked prefill)
    max_num_seqs: int = 64                  # requests running at once
    max_len: int | None = None              # max-length reservation; default: the longest request
    enable_prefix_caching: bool = True      # paged: only matters when prompts share a prefix
    policy: str = "fcfs"
    max_model_len: int = 1 << 30            # context limit for stopping (the trace's model's)
    bytes_per_slot: int = 1
    validate: bool = True                   # paged: reject requests that could never fit (off
                                            # for traces: the engine accepted all of them)
    idle_steps: bool = True                 # count steps where nothing runs (synthetic timelines)
    keep_snapshots: bool = True
    wrap: int = 64                          # columns when drawing a contiguous address space

    @property
    def num_blocks(self) -> int:
        return self.budget_slots // self.block_size


@dataclass
class SimStep:
    step: int
    allocated_slots: int
    token_slots: int
    internal_slots: int
    reserved_slots: int
    external_slots: int
    free_slots: int
    cached_slots: int
    num_running: int
    num_waiting: int
    num_finished: int
    num_preemptions: int                    # cumulative
    prefix_hit_tokens: int                  # cumulative

    @property
    def waste_fraction(self) -> float:
        return 1.0 - self.token_slots / self.allocated_slots if self.allocated_slots else 0.0


@dataclass
class SimResult:
    allocator: str
    config: SimConfig
    steps: list[SimStep]
    snapshots: list[MemorySnapshot]
    num_requests: int
    rejected: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        """One row of notebook 05's table (time-averaged like ``RunMetrics.kv_waste_pct``)."""
        alloc = sum(s.allocated_slots for s in self.steps)
        tok = sum(s.token_slots for s in self.steps)
        budget = self.config.budget_slots * max(1, len(self.steps))
        return {
            "allocator": self.allocator,
            "waste_pct": 100.0 * (1 - tok / alloc) if alloc else 0.0,
            "internal_pct": 100.0 * sum(s.internal_slots for s in self.steps) / alloc if alloc else 0.0,
            "reserved_pct": 100.0 * sum(s.reserved_slots for s in self.steps) / alloc if alloc else 0.0,
            "external_pct_of_budget": 100.0 * sum(s.external_slots for s in self.steps) / budget,
            "peak_running": max((s.num_running for s in self.steps), default=0),
            "mean_running": float(np.mean([s.num_running for s in self.steps])) if self.steps else 0.0,
            "peak_token_slots": max((s.token_slots for s in self.steps), default=0),
            "steps": len(self.steps),
            "preemptions": self.steps[-1].num_preemptions if self.steps else 0,
            "prefix_hit_tokens": self.steps[-1].prefix_hit_tokens if self.steps else 0,
            "rejected": len(self.rejected),
        }


def waste_breakdown(snap: MemorySnapshot) -> dict:
    """Slots of each kind in a snapshot, by this module's definitions (works for every engine's
    snapshot: a block pool's unfilled slots are last-block tails, a rectangle's padding is
    internal waste, its reserved cells are future reservations)."""
    kind = snap.kind
    token = int((kind == TOKEN).sum())
    padding = int((kind == PADDING).sum())
    res = int((kind == RESERVED).sum())
    paged = snap.row_label == "block"
    return {"token": token, "internal": padding + (res if paged else 0),
            "reserved": 0 if paged else res, "external": int(snap.extra.get("external_slots", 0)),
            "cached": int((kind == CACHED).sum()), "free": int((kind == FREE).sum()),
            "allocated": token + padding + res}


# --- the paged allocator: the real PagedEngine, with a model that computes nothing ---------------
REPLAY_EOS = -2       # the replay "model"'s end-of-sequence token: ends each sample where it ended


@dataclass
class ReplayModel:
    """What the engine reads off a model, for replays that run none."""

    max_model_len: int
    kv_bytes_per_token: int
    eos_token_ids: set[int] = field(default_factory=lambda: {REPLAY_EOS})
    tokenizer: object = None
    device: torch.device = torch.device("cpu")
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(vocab_size=1 << 31))


class NullRunner:
    """A model runner that computes nothing: a scheduled token's K/V count as written at once.
    Which sequences reach their newest token, and in what order, is decided exactly as in
    ``ModelRunner.run``, so forks and frees happen in the engine's own order."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[Sequence], None]:
        order = step_order(scheduled)
        return [order[k][0] for k in reaching_end(order)], None


class ReplaySampler:
    """Emits the tokens each sample produced (recorded ones for a trace, ``DUMMY_TOKEN`` for a
    synthetic workload), and ends each sample after as many tokens as it had."""

    def __init__(self, requests: dict[str, SimRequest]):
        self.requests = requests

    def __call__(self, logits, rows: list[tuple[int, Sequence]]):
        tokens = []
        for _, seq in rows:
            r, k = self.requests[seq.request.request_id], len(seq.output_token_ids)
            last = k + 1 >= r.output_lens[seq.sample_id]
            tokens.append((seq, REPLAY_EOS if last else r.token(seq.sample_id, k)))
        return tokens, []


class PagedReplay:
    """The paged allocator *is* the paged engine: ``PagedEngine`` with its real scheduler, block
    manager and postprocess, given ``NullRunner`` and ``ReplaySampler``. Nothing here repeats what
    the engine does, so a replay cannot drift from it."""

    name = "paged"

    def __init__(self, cfg: SimConfig):
        from ..engines.s3_paged.engine import PagedEngine
        self.cfg = cfg
        self.requests: dict[str, SimRequest] = {}
        self.engine = PagedEngine(
            ReplayModel(cfg.max_model_len, cfg.bytes_per_slot), block_size=cfg.block_size,
            num_blocks=cfg.num_blocks, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.enable_prefix_caching,
            policy=cfg.policy, runner=NullRunner(), sampler=ReplaySampler(self.requests))
        self.bm, self.scheduler = self.engine.block_manager, self.engine.scheduler
        self.num_finished = 0

    @staticmethod
    def _request(r: SimRequest) -> Request:
        params = SamplingParams(max_tokens=r.max_tokens, n=r.n)
        return Request(list(r.prompt_token_ids), params, request_id=r.request_id,
                       priority=r.priority)

    def fits(self, r: SimRequest) -> bool:
        """Whether the engine would accept the request (``PagedEngine.validate``)."""
        try:
            self.engine.validate(self._request(r))
        except RequestError:
            return False
        return True

    def add(self, r: SimRequest) -> None:
        self.requests[r.request_id] = r
        self.engine.add_request(self._request(r))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> None:
        self.num_finished += len(self.engine.step().finished)

    def measure(self, step: int) -> tuple[SimStep, MemorySnapshot | None]:
        live = self.scheduler.live_seqs()
        st = self.bm.stats(live)
        bs = self.cfg.block_size
        rec = SimStep(step, st.allocated_slots, st.token_slots, st.allocated_slots - st.token_slots,
                      0, 0, st.free * bs, st.cached * bs, len(self.scheduler.running),
                      len(self.scheduler.waiting), self.num_finished,
                      self.scheduler.num_preemptions, self.bm.prefix_hits)
        snap = None
        if self.cfg.keep_snapshots:
            snap = self.bm.snapshot(live, ALLOCATOR_LABELS["paged"], step, self.cfg.bytes_per_slot)
        return rec, snap


# --- the contiguous allocators ------------------------------------------------------------------
@dataclass(eq=False)
class _Seq:
    request: SimRequest
    sample: int
    num_tokens: int
    start: int
    size: int
    num_computed: int = 0
    done: bool = False

    @property
    def num_outputs(self) -> int:
        return self.num_tokens - self.request.prompt_len


@dataclass(eq=False)
class _Group:
    request: SimRequest
    seqs: list[_Seq] = field(default_factory=list)


class ContiguousSim:
    """Every sequence's KV in one contiguous region of a single address space, reserved when the
    request is admitted and freed when it finishes. Regions are placed first-fit; admission is
    strictly first come, first served (the head of the queue waits until a hole fits it, nobody
    overtakes it), so holes that are too small show up as external fragmentation.

    The schedule mirrors the paged one (token budget, chunked prefill, max_num_seqs) so that the
    allocators differ in memory only. With n > 1 each sample needs its own region holding its own
    copy of the prompt, as in a contiguous batch."""

    def __init__(self, cfg: SimConfig, mode: str, max_len: int):
        assert mode in ("max-length", "exact")
        self.cfg, self.mode, self.max_len = cfg, mode, max_len
        self.name = mode
        self.waiting: deque[_Group] = deque()
        self.running: list[_Group] = []
        self.regions: list[_Seq] = []           # live regions, sorted by start
        self.num_finished = 0

    def region_size(self, r: SimRequest) -> int:
        return self.max_len if self.mode == "max-length" else r.prompt_len + r.max_tokens

    def fits(self, r: SimRequest) -> bool:
        return r.n * self.region_size(r) <= self.cfg.budget_slots and \
            r.prompt_len + max(r.output_lens) <= self.region_size(r)

    def add(self, r: SimRequest) -> None:
        self.waiting.append(_Group(r))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def holes(self) -> list[tuple[int, int]]:
        """Free (start, length) gaps of the address space, in address order."""
        out, pos = [], 0
        for s in self.regions:
            if s.start > pos:
                out.append((pos, s.start - pos))
            pos = s.start + s.size
        if pos < self.cfg.budget_slots:
            out.append((pos, self.cfg.budget_slots - pos))
        return out

    def _place(self, sizes: list[int]) -> list[int] | None:
        """First-fit places for all ``sizes`` at once, or None (then nothing is taken)."""
        holes = [list(h) for h in self.holes()]
        starts = []
        for size in sizes:
            for h in holes:
                if h[1] >= size:
                    starts.append(h[0])
                    h[0] += size
                    h[1] -= size
                    break
            else:
                return None
        return starts

    def step(self) -> None:
        budget = self.cfg.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        for g in self.running:
            live = [s for s in g.seqs if not s.done]
            if all(s.num_tokens - s.num_computed == 1 for s in live) and len(live) > budget:
                continue                         # samples decode together, or not at all
            for s in live:
                n = min(s.num_tokens - s.num_computed, budget)
                if n == 0:
                    break
                scheduled.append((s, n))
                budget -= n
            if budget == 0:
                break
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            g = self.waiting[0]
            r = g.request
            size = self.region_size(r)
            starts = self._place([size] * r.n)
            if starts is None:
                break                            # strict FCFS: the head waits for a hole
            self.waiting.popleft()
            g.seqs = [_Seq(r, k, r.prompt_len, st, size) for k, st in enumerate(starts)]
            self.regions = sorted(self.regions + g.seqs, key=lambda s: s.start)
            self.running.append(g)
            for s in g.seqs:
                n = min(s.num_tokens, budget)
                if n == 0:
                    break
                scheduled.append((s, n))
                budget -= n
        reached = [s for s, n in scheduled if s.num_computed + n == s.num_tokens]
        for s, n in scheduled:
            s.num_computed += n
        for s in reached:
            s.num_tokens += 1                    # the sampled token: in KV from the next step on
            if s.num_outputs >= s.request.output_lens[s.sample]:
                s.done = True
                self.regions.remove(s)
        for g in [g for g in self.running if all(s.done for s in g.seqs)]:
            self.running.remove(g)
            self.num_finished += 1

    def external(self) -> tuple[int, list[tuple[int, int]]]:
        """Free slots in holes too small for the request at the head of the queue."""
        if not self.waiting:
            return 0, []
        need = self.region_size(self.waiting[0].request)
        small = [h for h in self.holes() if h[1] < need]
        return sum(n for _, n in small), small

    def measure(self, step: int) -> tuple[SimStep, MemorySnapshot | None]:
        allocated = sum(s.size for s in self.regions)
        tokens = sum(s.num_computed for s in self.regions)
        ext, small = self.external()
        rec = SimStep(step, allocated, tokens, 0, allocated - tokens, ext,
                      self.cfg.budget_slots - allocated, 0, len(self.running), len(self.waiting),
                      self.num_finished, 0, 0)
        return rec, (self._snapshot(step, small, ext) if self.cfg.keep_snapshots else None)

    def _snapshot(self, step: int, small: list[tuple[int, int]], ext: int) -> MemorySnapshot:
        budget, wrap = self.cfg.budget_slots, self.cfg.wrap
        rows = -(-budget // wrap)
        kind = np.full(rows * wrap, FREE, dtype=np.int8)
        owner = np.full(rows * wrap, -1, dtype=np.int32)
        owners: list[str] = []
        for s in self.regions:
            rid = s.request.request_id
            if rid not in owners:
                owners.append(rid)
            kind[s.start:s.start + s.size] = RESERVED
            kind[s.start:s.start + s.num_computed] = TOKEN
            owner[s.start:s.start + s.size] = owners.index(rid)
        return MemorySnapshot(ALLOCATOR_LABELS[self.mode], step, kind.reshape(rows, wrap),
                              owner.reshape(rows, wrap), owners, self.cfg.bytes_per_slot,
                              "address row",
                              extra={"external_slots": ext, "external_holes": small,
                                     "budget_slots": budget})


# --- running a workload -------------------------------------------------------------------------
def make_allocator(name: str, cfg: SimConfig, requests: list[SimRequest]):
    if name == "paged":
        return PagedReplay(cfg)
    if name in ("max-length", "exact"):
        max_len = cfg.max_len or max((r.prompt_len + r.max_tokens for r in requests), default=1)
        return ContiguousSim(cfg, name, max_len)
    raise ValueError(f"unknown allocator {name!r}: choose one of {', '.join(ALLOCATORS)}")


def simulate(requests: list[SimRequest], allocator: str = "paged", config: SimConfig | None = None,
             max_steps: int = 100_000) -> SimResult:
    """Serve ``requests`` with ``allocator``; one ``SimStep`` (and snapshot) per engine step.

    Mirrors ``Engine.run``: before each step, every request whose ``arrival_step`` has come is
    added (in list order among equals); a request that could never fit the budget alone is
    rejected, as the engines reject it. With ``config.idle_steps`` an empty system still ticks
    (synthetic timelines where arrival steps are clock time); without it, like the engine, it
    jumps to the next arrival without recording a step.
    """
    cfg = config or SimConfig()
    alloc = make_allocator(allocator, cfg, requests)
    pending = deque(sorted(requests, key=lambda r: r.arrival_step))
    steps, snaps, rejected = [], [], []
    clock = 0
    while pending or alloc.has_unfinished():
        while pending and pending[0].arrival_step <= clock:
            r = pending.popleft()
            # a contiguous allocator must always turn away what can never fit: it would wait forever
            if (allocator == "paged" and not cfg.validate) or alloc.fits(r):
                alloc.add(r)
            else:
                rejected.append(r.request_id)
        if not alloc.has_unfinished():
            if pending and not cfg.idle_steps:
                clock = pending[0].arrival_step
                continue
            if not pending:
                break
        if len(steps) >= max_steps:
            raise RuntimeError(f"{allocator}: not done after {max_steps} steps")
        if alloc.has_unfinished():
            alloc.step()
        clock += 1
        rec, snap = alloc.measure(len(steps) + 1)
        steps.append(rec)
        if snap is not None:
            snaps.append(snap)
    return SimResult(allocator, cfg, steps, snaps, len(requests), rejected)


def compare(requests: list[SimRequest], config: SimConfig | None = None,
            allocators: tuple[str, ...] = ALLOCATORS) -> dict[str, SimResult]:
    """The same workload through every allocator at the same budget."""
    return {a: simulate(requests, a, config) for a in allocators}


def summary_table(results: dict[str, SimResult]) -> str:
    """Plain-text table of ``SimResult.summary`` rows (notebooks show an HTML one)."""
    cols = [("allocator", "allocator", "{}"), ("waste_pct", "waste %", "{:.1f}"),
            ("external_pct_of_budget", "external % of pool", "{:.1f}"),
            ("peak_running", "peak running", "{}"), ("steps", "steps", "{}"),
            ("preemptions", "preemptions", "{}")]
    rows = [[fmt.format(r.summary()[k]) for k, _, fmt in cols] for r in results.values()]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, (_, h, _) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for (_, h, _), w in zip(cols, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


# --- traces of real engine runs -----------------------------------------------------------------
class TraceRecorder:
    """Notes the engine step at which each request is added (for arrivals spread over time).

    ``Engine.run`` adds a request between steps; this wraps the engine instance's ``add_request``
    so the trace knows after how many steps each request arrived. Arrivals all at t=0 need no
    recorder: every request is added before step 1.
    """

    def __init__(self, engine):
        self.engine = engine
        self.added: dict[str, int] = {}
        self.order: list[str] = []
        inner = engine.add_request

        def add_request(req):
            inner(req)
            self.added[req.request_id] = engine.step_count
            self.order.append(req.request_id)

        engine.add_request = add_request


@dataclass
class Trace:
    """A paged engine run, reduced to what the allocator needs to reproduce it."""

    requests: list[SimRequest]            # in the order the engine added them
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    policy: str
    max_model_len: int
    bytes_per_slot: int
    engine_steps: list[dict] = field(default_factory=list)   # the engine's own StepRecords
    source: str = ""

    def config(self, **overrides) -> SimConfig:
        kw = dict(budget_slots=self.num_blocks * self.block_size, block_size=self.block_size,
                  max_num_batched_tokens=self.max_num_batched_tokens,
                  max_num_seqs=self.max_num_seqs, enable_prefix_caching=self.enable_prefix_caching,
                  policy=self.policy, max_model_len=self.max_model_len,
                  bytes_per_slot=self.bytes_per_slot, validate=False, idle_steps=False)
        kw.update(overrides)
        return SimConfig(**kw)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Trace":
        d = dict(d)
        d["requests"] = [SimRequest(**r) for r in d["requests"]]
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_dict(json.loads(Path(path).read_text()))


def trace_from_run(result, requests: list[Request], engine, added_steps: dict[str, int] | None = None,
                   source: str = "") -> Trace:
    """A ``Trace`` of ``engine.run(requests)`` (a ``PagedEngine``; ``result`` is its RunResult).

    ``added_steps`` maps request id -> engine steps done when it was added (``TraceRecorder.added``,
    or ``req.added_step`` if the engine sets it). Without either, every request must have arrived
    at t=0, which ``Engine.run`` adds before step 1: step 0 for all.
    """
    from ..engines.s3_paged.engine import PagedEngine
    from ..request import FinishReason as FR

    if not isinstance(engine, PagedEngine):
        raise TypeError(f"traces replay through the paged allocator: need a PagedEngine, "
                        f"got {type(engine).__name__}")
    outputs = {o.request_id: o for o in result.outputs}
    if added_steps is not None:      # a dict in the order the engine added the requests
        pos = {rid: i for i, rid in enumerate(added_steps)}
        order = sorted((r for r in requests if r.request_id in pos), key=lambda r: pos[r.request_id])
    else:                            # Engine.run adds in order of arrival (a stable sort)
        order = sorted(requests, key=lambda r: r.arrival_offset_s)
    sims = []
    for req in order:
        out = outputs[req.request_id]
        if out.finish_reason == FR.ERROR:
            continue                                 # rejected by validate: never added
        if out.finish_reason == FR.ABORT:
            raise ValueError(f"{req.request_id} was aborted: traces of aborted runs are not supported")
        if req.params.beam_width > 1:
            raise NotImplementedError("beam search is not replayed (its forks depend on scores)")
        if added_steps is not None:
            step = added_steps[req.request_id]
        elif getattr(req, "added_step", None) is not None:
            step = req.added_step
        elif req.arrival_offset_s == 0:
            step = 0
        else:
            raise ValueError(f"{req.request_id} arrived at {req.arrival_offset_s:.3f} s: record the "
                             "step it was added with TraceRecorder(engine) before engine.run")
        samples = out.samples if out.samples else [out.token_ids]
        sims.append(SimRequest(req.request_id, list(req.prompt_token_ids),
                               [len(s) for s in samples], req.params.max_tokens, step,
                               req.priority, [list(s) for s in samples]))
    sched = engine.scheduler
    return Trace(sims, engine.block_size, engine.block_manager.num_blocks,
                 sched.max_num_batched_tokens, sched.max_num_seqs,
                 engine.block_manager.enable_prefix_caching, sched.policy, engine.max_model_len,
                 engine.model.kv_bytes_per_token,
                 [{"step": s.step, "allocated_slots": s.allocated_slots,
                   "token_slots": s.token_slots, "num_running": s.num_running}
                  for s in result.steps], source)


def record_paged_run(llm_or_engine, requests: list[Request], on_step=None, progress: bool = False,
                     source: str = ""):
    """Run a paged engine with a ``TraceRecorder`` attached; return (RunResult, Trace).

    The engine must be fresh (no step run yet): a replay starts from an empty pool, and a used
    pool remembers its free-block order and, with prefix caching, its cached blocks."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    if engine.step_count:
        raise ValueError("record a trace on a fresh engine (this one has already run "
                         f"{engine.step_count} steps): create a new LLM/PagedEngine")
    rec = TraceRecorder(engine)
    result = engine.run(requests, on_step=on_step, progress=progress)
    return result, trace_from_run(result, requests, engine, rec.added, source)


def replay_trace(trace: Trace, allocator: str = "paged", **overrides) -> SimResult:
    """Run a recorded trace through an allocator. With ``paged`` and no overrides, the per-step
    allocated/token slots equal the engine's own StepRecords exactly."""
    return simulate(trace.requests, allocator, trace.config(**overrides))
