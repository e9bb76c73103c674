"""Soak test of the paged engine: thousands of random operations (add a request / abort an earlier
one / step) under many configurations, with the engine's whole state checked after every one.

Every plan is generated up front from a seed, as plain data (``Op``s), and then executed, so a
failure can be replayed, and shrunk, with ``run_soak(model, config, ops)`` (drop operations; an
abort whose request is gone is skipped).

What is checked:

* after every operation (``check_engine``): block reference counts equal the number of live block
  tables listing each block, the free queue is exactly the unreferenced blocks, the prefix-cache
  map is consistent, every computed token has a slot, finished samples/beams hold no blocks;
* after every step: the token budget and the sequence limit were respected, and the engine keeps
  making progress (a watchdog, instead of hanging forever);
* every request gets exactly one final answer (``RequestError`` at validation counts as one),
  ``abort`` says True exactly for requests still in flight, and those end ``ABORT`` with their
  partial samples intact;
* after draining, the pool is entirely free and the engine holds no request;
* every request that completed normally (and every aborted one's partial samples) matches, token
  for token, a run of the same requests on a roomy engine where nothing is preempted or cached.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from minillm import FinishReason, Request, RequestError, SamplingParams, load_model
from minillm.engines import create_engine
from minillm.core.block_manager import blocks_for_request
from minillm.request import RequestOutput

BLOCK_SIZES = (1, 2, 4, 8, 16)
MAX_PROMPT = 60
MAX_TOKENS = 12
STALL_STEPS = 500          # steps without any progress before the watchdog calls it a hang
MAX_DRAIN_STEPS = 20_000   # a hard bound on draining, whatever the watchdog says
P_ADD, P_ABORT = 0.16, 0.05   # the rest of the operations are steps
NUM_OPS = 1500


# --- plans: configurations and operations as plain data ---------------------------------------------
@dataclass
class SoakConfig:
    seed: int
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    policy: str
    tight: bool
    kinds: tuple[str, ...]     # request kinds drawn: "n1", "nmany" (n = 2..4), "beam"
    kv_cache_dtype: str = "auto"

    def engine_options(self) -> dict:
        return dict(block_size=self.block_size, num_blocks=self.num_blocks,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    max_num_seqs=self.max_num_seqs,
                    enable_prefix_caching=self.enable_prefix_caching, policy=self.policy,
                    kv_cache_dtype=self.kv_cache_dtype)


@dataclass
class Spec:
    """A request to submit: ``key`` names it in abort operations (its add's position)."""
    key: int
    prompt: list[int]
    params: dict
    priority: int
    invalid: bool = False      # built to be rejected by validation

    def make(self) -> Request:
        return Request(list(self.prompt), SamplingParams(**self.params), priority=self.priority)

    @property
    def width(self) -> int:
        return max(self.params.get("n", 1), self.params.get("beam_width", 1))

    @property
    def beam(self) -> bool:
        return self.params.get("beam_width", 1) > 1

    @property
    def deterministic(self) -> bool:
        return self.params.get("temperature", 0) == 0 or self.params.get("seed") is not None


@dataclass
class Op:
    kind: str                  # "add" | "abort" | "step"
    spec: Spec | None = None   # add
    target: int | None = None  # abort: the key of an earlier add

    def __repr__(self) -> str:
        if self.kind == "add":
            s = self.spec
            return f"add(key={s.key}, plen={len(s.prompt)}, {s.params}, prio={s.priority})"
        return f"abort({self.target})" if self.kind == "abort" else "step"


def make_config(seed: int, block_size: int, prefix: bool, policy: str, tight: bool,
                kinds: tuple[str, ...], kv_cache_dtype: str = "auto") -> SoakConfig:
    rng = random.Random(f"config-{seed}")
    max_width = max({"n1": 1, "nmany": 4, "beam": 3}[k] for k in kinds)
    worst = max(blocks_for_request(MAX_PROMPT, MAX_TOKENS, w, block_size) for w in {1, max_width})
    num_blocks = worst + rng.randint(0, 2) if tight else worst * rng.randint(3, 6)
    return SoakConfig(seed, block_size, num_blocks,
                      max_num_batched_tokens=rng.choice([8, 12, 16, 24, 32, 48, 64]),
                      max_num_seqs=rng.randint(3, 8) if tight else rng.randint(1, 8),
                      enable_prefix_caching=prefix, policy=policy, tight=tight, kinds=kinds,
                      kv_cache_dtype=kv_cache_dtype)


def make_ops(config: SoakConfig, num_ops: int, vocab: int) -> list[Op]:
    rng = random.Random(f"ops-{config.seed}")
    tok = lambda: rng.randrange(3, vocab)  # noqa: E731  (0, 1, 2 = pad, bos, eos)
    bases = [[tok() for _ in range(rng.randint(8, MAX_PROMPT))] for _ in range(3)]
    ops: list[Op] = []
    keys: list[int] = []
    for _ in range(num_ops):
        r = rng.random()
        if r < P_ADD:
            spec = make_spec(rng, len(ops), config, bases, tok, vocab)
            keys.append(spec.key)
            ops.append(Op("add", spec))
        elif r < P_ADD + P_ABORT and keys:
            # mostly a recent request (likely still in flight), sometimes any earlier one
            ops.append(Op("abort", target=rng.choice(keys[-8:] if rng.random() < 0.7 else keys)))
        else:
            ops.append(Op("step"))
    return ops


def make_spec(rng: random.Random, key: int, config: SoakConfig, bases, tok, vocab: int) -> Spec:
    # the prompt: often a shared prefix (so prefix caching hits) plus a tail of its own
    if rng.random() < 0.45:
        base = rng.choice(bases)
        prompt = base[:rng.randint(1, len(base))]
        prompt += [tok() for _ in range(rng.randint(0, MAX_PROMPT - len(prompt)))]
    else:
        prompt = [tok() for _ in range(rng.randint(1, MAX_PROMPT))]
    kind = rng.choices(config.kinds, weights=[{"n1": 5, "nmany": 3, "beam": 2}[k]
                                             for k in config.kinds])[0]
    params: dict = dict(max_tokens=rng.randint(1, MAX_TOKENS), ignore_eos=rng.random() < 0.5)
    sampled = dict(temperature=rng.choice([0.7, 1.0, 1.5]), top_k=rng.choice([0, 0, 5, 50]),
                   top_p=rng.choice([1.0, 1.0, 0.9]), seed=rng.randint(0, 1000))
    if kind == "n1":
        if rng.random() < 0.5:
            params.update(sampled)
    elif kind == "nmany":
        params["n"] = rng.randint(2, 4)
        if rng.random() < 0.75:
            params.update(sampled)
    else:
        params["beam_width"] = rng.randint(2, 3)
    spec = Spec(key, prompt, params, priority=rng.randint(0, 2))
    r = rng.random()
    if r < 0.01:       # can never fit the pool
        spec.prompt = [tok() for _ in range(config.num_blocks * config.block_size + 1)]
        spec.invalid = True
    elif r < 0.015:
        spec.prompt, spec.invalid = [], True
    elif r < 0.02:
        spec.prompt, spec.invalid = spec.prompt + [vocab + 7], True
    return spec


# --- invariants ----------------------------------------------------------------------------------
def live_groups(engine) -> list:
    return engine.scheduler.running + engine.scheduler.waiting


def find_group(engine, request_id: str):
    return next((g for g in live_groups(engine) if g.request.request_id == request_id), None)


def check_engine(engine) -> None:
    """The block manager's books balance against the sequences the scheduler knows about."""
    bm, sched = engine.block_manager, engine.scheduler
    groups = live_groups(engine)
    assert len({id(g) for g in groups}) == len(groups), "a group is queued twice"
    assert len(sched.running) <= sched.max_num_seqs, "more running requests than max_num_seqs"
    live = [s for g in groups for s in g.seqs]
    assert len({id(s) for s in live}) == len(live), "a sequence is listed twice"
    for g in groups:
        for s in g.done_seqs:
            assert not s.block_table, f"{g.request.request_id}: a finished sample holds blocks"
    held = Counter(b for s in live for b in s.block_table)
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), \
            f"{s.request.request_id}: a block table lists a block twice: {s.block_table}"
        assert 0 <= s.num_computed_tokens <= s.num_tokens, \
            f"{s.request.request_id}: {s.num_computed_tokens} of {s.num_tokens} tokens computed"
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens, \
            f"{s.request.request_id}: computed tokens without a slot"
    assert len(bm.free_queue) == len(set(bm.free_queue))
    free = set(bm.free_queue)
    for b in bm.blocks:
        assert b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}"
        assert b.ref_count == held.get(b.block_id, 0), (
            f"block {b.block_id}: ref_count {b.ref_count} but {held.get(b.block_id, 0)} live "
            f"block tables list it")
        assert (b.ref_count == 0) == (b.block_id in free), \
            f"block {b.block_id} (ref_count {b.ref_count}) is wrongly {'' if b.block_id in free else 'not '}free"
    used = sum(1 for b in bm.blocks if b.ref_count > 0)
    assert bm.num_free_blocks + used == bm.num_blocks
    for h, bid in bm.cached.items():
        assert bm.blocks[bid].hash == h, f"prefix cache maps a hash to block {bid} of another hash"
    for b in bm.blocks:
        if b.hash is not None:
            assert bm.cached.get(b.hash) == b.block_id, f"block {b.block_id} has a stray hash"
    if not bm.enable_prefix_caching:
        assert not bm.cached


def describe(engine) -> str:
    bm, sched = engine.block_manager, engine.scheduler

    def group(g):
        p = g.request.params
        seqs = ", ".join(f"[sample {s.sample_id}: {s.num_tokens} tokens ({s.prompt_len} prompt), "
                         f"{s.num_computed_tokens} computed, {len(s.block_table)} blocks"
                         f"{', pending logprobs' if s.pending_logprobs is not None else ''}]"
                         for s in g.seqs)
        return (f"  {g.request.request_id} n={p.n} beam={p.beam_width} max_tokens={p.max_tokens} "
                f"prio={g.request.priority} preempted {g.request.num_preemptions}x, "
                f"{len(g.done_seqs)} done; seqs: {seqs or 'none'}")

    def listing(name, groups, most=6):
        more = [f"  ... and {len(groups) - most} more"] if len(groups) > most else []
        return [f"{name} ({len(groups)}):", *map(group, groups[:most]), *more]

    return "\n".join([f"free blocks {bm.num_free_blocks}/{bm.num_blocks}, "
                      f"preemptions {sched.num_preemptions}, engine.groups {len(engine.groups)}",
                      *listing("running", sched.running), *listing("waiting", sched.waiting)])


# --- the driver ----------------------------------------------------------------------------------
@dataclass
class SoakRun:
    config: SoakConfig
    engine: object
    specs: dict[int, Spec] = field(default_factory=dict)          # key -> spec
    reqs: dict[int, Request] = field(default_factory=dict)        # key -> request
    key_of: dict[str, int] = field(default_factory=dict)          # request id -> key
    finals: Counter = field(default_factory=Counter)              # key -> final answers
    outputs: dict[int, RequestOutput] = field(default_factory=dict)
    aborted: dict[int, dict] = field(default_factory=dict)        # key -> partial samples
    rejected: set[int] = field(default_factory=set)
    stall: int = 0
    progress_key: tuple = ()
    op_index: int = 0
    num_steps: int = 0

    def where(self) -> str:
        return f"op {self.op_index}, step {self.num_steps}, {self.config}"

    def add(self, spec: Spec) -> None:
        req = spec.make()
        self.specs[spec.key], self.reqs[spec.key] = spec, req
        self.key_of[req.request_id] = spec.key
        try:
            self.engine.validate(req)
        except RequestError as e:
            req.finish(FinishReason.ERROR, error=str(e))
            self.rejected.add(spec.key)
            self._final(spec.key, RequestOutput.from_request(req))
            return
        assert not spec.invalid, f"{spec} should have been rejected"
        self.engine.add_request(req)

    def abort(self, key: int) -> None:
        if key not in self.reqs:
            return
        req = self.reqs[key]
        in_flight = key not in self.rejected and self.finals[key] == 0 and key not in self.aborted
        group = find_group(self.engine, req.request_id)
        assert (group is not None) == in_flight, f"{req.request_id}: in flight {in_flight} but " \
            f"{'queued' if group else 'not queued'} ({self.where()})"
        partial = None
        if group is not None:   # what has been generated so far: the abort must not lose it
            partial = dict(seqs=[(s.sample_id, list(s.output_token_ids)) for s in group.seqs],
                           done=[(s.sample_id, list(s.output_token_ids)) for s in group.done_seqs])
        ok = self.engine.abort(req.request_id)
        assert ok == in_flight, f"abort({req.request_id}) returned {ok}, in flight: {in_flight}"
        if ok:
            self.aborted[key] = partial
            assert find_group(self.engine, req.request_id) is None, "an aborted request is still queued"
            assert not self.engine.abort(req.request_id), "aborting twice is a no-op"

    def step(self) -> None:
        engine, cfg = self.engine, self.config
        if not engine.has_unfinished():
            return
        try:
            out = engine.step()
        except Exception as e:
            raise AssertionError(f"engine.step() raised {e!r} at {self.where()}\n"
                                 f"{describe(engine)}") from e
        self.num_steps += 1
        assert out.num_prefill_tokens + out.num_decode_tokens <= cfg.max_num_batched_tokens
        for req in out.finished:
            assert req.finished, f"{req.request_id} returned as finished without a reason"
            self._final(self.key_of[req.request_id], engine.make_output(req))
        key = (sum(self.finals.values()),
               sum(len(s.output_token_ids) for g in live_groups(engine) for s in g.seqs + g.done_seqs))
        if key != self.progress_key or not engine.has_unfinished():
            self.progress_key, self.stall = key, 0
            return
        self.stall += 1
        assert self.stall < STALL_STEPS, (
            f"no progress for {self.stall} steps (nothing finished, no token appended) at "
            f"{self.where()}\n{describe(engine)}")

    def _final(self, key: int, out: RequestOutput) -> None:
        self.finals[key] += 1
        assert self.finals[key] == 1, f"{out.request_id} answered twice"
        self.outputs[key] = out

    def drain(self) -> None:
        for _ in range(MAX_DRAIN_STEPS):
            if not self.engine.has_unfinished():
                return
            self.step()
            check_engine(self.engine)
        raise AssertionError(f"not drained after {MAX_DRAIN_STEPS} steps\n{describe(self.engine)}")


def run_soak(model, config: SoakConfig, ops: list[Op]) -> SoakRun:
    engine = create_engine("paged", model, **config.engine_options())
    run = SoakRun(config, engine)
    for i, op in enumerate(ops):
        run.op_index = i
        if op.kind == "add":
            run.add(op.spec)
        elif op.kind == "abort":
            run.abort(op.target)
        else:
            run.step()
        check_engine(engine)
    run.op_index = len(ops)
    run.drain()
    return run


def run_roomy(model, specs: list[Spec], kv_cache_dtype: str = "auto") -> dict[int, RequestOutput]:
    """The same requests on a pool where nothing is preempted or cached: the reference (its KV
    stored as the soaked engine's is: a quantized row depends on the row alone, so blocks that
    were copied, cached, freed and recomputed must still give the same tokens)."""
    engine = create_engine("paged", model, num_blocks=4096, enable_prefix_caching=False,
                           max_num_seqs=256, max_num_batched_tokens=4096,
                           kv_cache_dtype=kv_cache_dtype)
    reqs = {spec.key: spec.make() for spec in specs}
    key_of = {r.request_id: k for k, r in reqs.items()}
    for req in reqs.values():
        engine.validate(req)
        engine.add_request(req)
    outputs: dict[int, RequestOutput] = {}
    for _ in range(MAX_DRAIN_STEPS):
        if not engine.has_unfinished():
            break
        for req in engine.step().finished:
            outputs[key_of[req.request_id]] = engine.make_output(req)
    assert not engine.has_unfinished(), "the roomy reference run never drained"
    assert engine.scheduler.num_preemptions == 0, "the reference must not preempt"
    return outputs


# --- checking the answers ------------------------------------------------------------------------
def check_completed(spec: Spec, out: RequestOutput, eos: set[int]) -> None:
    p = SamplingParams(**spec.params)
    label = f"{out.request_id} ({spec})"
    assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), label
    assert out.samples and out.token_ids == out.samples[0], f"{label}: token_ids is not samples[0]"
    if spec.beam:
        assert 1 <= len(out.samples) <= p.beam_width, f"{label}: {len(out.samples)} beams"
    else:
        assert len(out.samples) == p.n, f"{label}: {len(out.samples)} samples, not n={p.n}"
    for s in out.samples:
        assert 1 <= len(s) <= p.max_tokens, f"{label}: a sample of {len(s)} tokens"
        if not p.ignore_eos:
            assert not eos & set(s[:-1]), f"{label}: went on after EOS: {s}"
        if not spec.beam:   # beam search may stop early (no running beam can beat the done ones)
            stopped = not p.ignore_eos and s[-1] in eos
            assert stopped or len(s) == p.max_tokens, f"{label}: stopped short: {s}"
    if not spec.beam:
        stopped = not p.ignore_eos and out.token_ids[-1] in eos
        assert out.finish_reason == (FinishReason.STOP if stopped else FinishReason.LENGTH), label
        if p.greedy:
            assert all(s == out.samples[0] for s in out.samples), f"{label}: greedy samples differ"


def check_aborted(spec: Spec, out: RequestOutput, partial: dict, ref: RequestOutput | None) -> None:
    """An aborted request keeps what it had generated: every sample (n > 1), or beams and finished
    hypotheses (beam search), and each is a prefix of what the request would have produced."""
    label = f"{out.request_id} ({spec}) aborted"
    assert out.finish_reason == FinishReason.ABORT, label
    assert out.samples and out.token_ids == out.samples[0], f"{label}: token_ids is not samples[0]"
    have = partial["seqs"] + partial["done"]
    if spec.beam:
        allowed = [t for _, t in have]
        assert 1 <= len(out.samples) <= max(1, len(allowed)), f"{label}: {out.samples}"
        assert all(s in allowed for s in out.samples), (
            f"{label}: samples {out.samples} are not its beams/hypotheses at abort time {allowed}")
        return
    expect = [t for _, t in sorted(have)]
    assert sorted(out.samples) == sorted(expect), (
        f"{label}: partial samples lost: got {out.samples}, had {expect} at abort time")
    if ref is not None:
        for sample_id, toks in have:
            full = ref.samples[sample_id]
            assert full[:len(toks)] == toks, (
                f"{label}: sample {sample_id} {toks} is not a prefix of the roomy run's {full}")


def check_run(model, run: SoakRun) -> dict:
    engine, bm = run.engine, run.engine.block_manager
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    check_engine(engine)
    assert not engine.groups, f"engine.groups still holds {len(engine.groups)} requests"
    for key in run.specs:
        assert run.finals[key] == 1, f"{run.reqs[key].request_id}: {run.finals[key]} final answers"
    eos = model.eos_token_ids
    compare = [s for k, s in run.specs.items() if k not in run.rejected and s.deterministic]
    refs = run_roomy(model, compare, run.config.kv_cache_dtype)
    stats = Counter()
    for key, spec in run.specs.items():
        out = run.outputs[key]
        if key in run.rejected:
            assert out.finish_reason == FinishReason.ERROR and out.error
            stats["rejected"] += 1
        elif key in run.aborted:
            check_aborted(spec, out, run.aborted[key], refs.get(key))
            stats["aborted"] += 1
        else:
            check_completed(spec, out, eos)
            stats["completed"] += 1
            if key in refs:
                ref = refs[key]
                assert (out.samples, out.finish_reason) == (ref.samples, ref.finish_reason), (
                    f"{out.request_id} ({spec}): differs from the roomy run\n"
                    f"got {out.finish_reason} {out.samples}\nref {ref.finish_reason} {ref.samples}")
                stats["compared"] += 1
        stats[f"kind={'beam' if spec.beam else 'n>1' if spec.width > 1 else 'n=1'}"] += 1
        if spec.width > 1 and out.num_preemptions:
            stats["preempted_n>1_or_beam"] += 1
    stats["preemptions"] = engine.scheduler.num_preemptions
    stats["prefix_hit_tokens"] = bm.prefix_hits
    stats["steps"] = run.num_steps
    return stats


# --- the tests -----------------------------------------------------------------------------------
ALL_KINDS = ("n1", "nmany", "beam")
#            seed, block size, prefix caching, policy, tight pool
MIXED = [(101, 4, True, "fcfs", True),
         (102, 1, False, "fcfs", True),
         (103, 16, True, "priority", True),
         (104, 2, False, "priority", True),
         (105, 8, True, "fcfs", True),
         (106, 2, True, "score", False),
         (107, 1, True, "score", True),
         (108, 8, False, "fcfs", True)]
N1_ONLY = [(201, 4, True, "fcfs", True),
           (202, 1, True, "priority", True),
           (203, 8, False, "score", True),
           (204, 16, True, "fcfs", False)]


@pytest.fixture(scope="module")
def tiny64():
    """The tiny model in float64, on the CPU. The soak compares tight runs with a roomy run token
    for token, and in fp32 the batch shape moves logits in the last bits: often enough to flip a
    seeded draw that sits near a boundary of its distribution (2 of 30 soak configurations did).
    In float64 that never happens, while a real bug (a wrong slot, a lost block) still shows."""
    return load_model("tiny-llama", device="cpu", dtype=torch.float64)


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matmuls are too small to gain from threads, and two threads on a busy
    2-core machine can make every step many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def soak(model, seed, block_size, prefix, policy, tight, kinds, num_ops, kv_cache_dtype="auto"):
    config = make_config(seed, block_size, prefix, policy, tight, kinds, kv_cache_dtype)
    ops = make_ops(config, num_ops, model.config.vocab_size)
    run = run_soak(model, config, ops)
    stats = check_run(model, run)
    print(config, dict(stats))
    # the plan must exercise what it is meant to
    assert stats["rejected"] <= 0.1 * len(run.specs), "most requests should be valid"
    assert stats["aborted"] > 0 and stats["compared"] > 0.3 * len(run.specs)
    if tight:
        assert stats["preemptions"] > 0, "a tight pool should preempt"
        if kinds != ("n1",):
            assert stats["preempted_n>1_or_beam"] > 0, "n > 1 and beam groups should be preempted"
    if prefix:
        assert stats["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("seed,block_size,prefix,policy,tight", MIXED)
def test_soak_paged(tiny64, seed, block_size, prefix, policy, tight):
    """n = 1, n > 1 and beam search mixed, on tight pools."""
    soak(tiny64, seed, block_size, prefix, policy, tight, ALL_KINDS, num_ops=NUM_OPS)


@pytest.mark.parametrize("seed,block_size,prefix,policy,tight", N1_ONLY)
def test_soak_paged_n1(tiny64, seed, block_size, prefix, policy, tight):
    """n = 1 requests only (greedy and sampled)."""
    soak(tiny64, seed, block_size, prefix, policy, tight, ("n1",), num_ops=NUM_OPS)


@pytest.mark.parametrize("seed,block_size,kv_cache_dtype", [(301, 4, "int8"), (302, 2, "fp8"),
                                                         (303, 8, "bfloat16")])
def test_soak_quantized_cache(tiny64, seed, block_size, kv_cache_dtype):
    """A narrow cache (rung 9) under the same pressure: forks, copy-on-write, prefix hits,
    preemption, aborts. Scales must travel with their blocks (a copy that left them behind, or a
    recomputed block read with a stale scale, gives other tokens than the roomy run)."""
    soak(tiny64, seed, block_size, True, "fcfs", True, ALL_KINDS, NUM_OPS, kv_cache_dtype)


def test_step_driven_engine_forgets_finished_requests(tiny):
    """Driven by ``step()`` alone (no ``make_output``), as a server loop may be, the engine must
    not keep finished requests forever; ``make_output`` still gives every sample afterwards."""
    engine = create_engine("paged", tiny, block_size=4, num_blocks=64)
    rng = random.Random(7)
    kinds = [dict(), dict(n=3, temperature=1.0, seed=1), dict(beam_width=2)]
    reqs = [Request([rng.randrange(3, 500) for _ in range(rng.randint(1, 20))],
                    SamplingParams(max_tokens=4, ignore_eos=True, **kinds[i % 3])) for i in range(9)]
    for r in reqs:
        engine.add_request(r)
    engine.step()
    assert engine.abort(reqs[0].request_id)
    finished = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        finished += engine.step().finished
    assert sorted(r.request_id for r in finished) == sorted(r.request_id for r in reqs)
    assert len(engine.groups) == 0, f"engine.groups holds {len(engine.groups)} finished requests"
    for r in reqs[1:]:
        out = engine.make_output(r)
        width = max(r.params.n, r.params.beam_width)
        assert len(out.samples) == width and all(len(s) == 4 for s in out.samples), out.samples
