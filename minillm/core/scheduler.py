"""The scheduler: each step, which sequences run and how many tokens each (notebook 03).

It is nothing but a token budget (vLLM v1's design). Each step may compute at most
``max_num_batched_tokens`` tokens for at most ``max_num_seqs`` requests:

1. running requests first — a decoding sequence needs 1 token, a sequence still in its prompt
   needs the rest of the prompt (or as much of it as the budget allows);
2. then waiting requests, in policy order, while budget, sequence slots and blocks last.

Chunked prefill falls out of the budget: a 2,000-token prompt with a 512-token budget simply
takes four steps, and decodes ride along in each of them instead of stalling.

The order is the policy's (``core/policy.py``: FCFS; notebook 08's others plug in). When a
running sequence needs a block and none is free, the scheduler *preempts* the lowest-ranked
running request (the newest, under FCFS): frees all its blocks and puts it back at the front of
the waiting queue, to be recomputed later from its tokens (recompute preemption). A policy may
also let a waiting request that cannot be seated evict a lower-ranked running one
(``_preempt_for``); a request is never re-admitted in the step it was preempted. The request
being scheduled can always evict everyone ranked below it, and a request alone in the pool always
fits (checked on arrival), so this never deadlocks.

A preempted request with several sequences (n > 1 samples, beams) recomputes its prompt *once*:
its first sequence computes the prompt alone, then the others adopt those blocks (as the original
fork did) and compute only their own tokens. Recomputing each sample's prompt separately would need
more blocks than the request was admitted with, and could never fit a tight pool.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Collection
from dataclasses import dataclass

from .allocator import KVAllocator
from ..checks import check_field
from ..request import FinishReason, Request, RequestError
from .beam import select_beams
from .budget import BatchController, FixedBatch
from .commit import Emit, SelectBeams, StepCommit
from .policy import FCFS, SchedulingPolicy
from .sequence import Sequence, SequenceGroup



@dataclass(frozen=True)
class Constraints:
    """What one ``schedule()`` call must respect besides the budget, the seats and the blocks,
    when a rung asks more of it: ``exclude``, running groups neither scheduled nor preempted (they
    keep their seats: a step holding them is in flight); ``max_new``, the most waiting groups to
    admit; ``admit(group)``, whether a waiting group may start now (one it refuses is passed
    over, and the rule answers for not starving it)."""

    exclude: Collection[SequenceGroup] = ()
    max_new: int | None = None
    admit: Callable[[SequenceGroup], bool] | None = None


NONE = Constraints()


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]       # (sequence, tokens to compute this step)
    copies: list[tuple[int, int]]               # copy-on-write block copies to do first
    preempted: list[SequenceGroup]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler(StepCommit):
    """Owns the requests in flight (``groups``) and the KV allocator (the ``BlockManager``, or
    any other ``minillm.core.allocator.KVAllocator``): ``schedule`` decides a step, ``update_from_output``
    (``core/commit.py``) commits it (tokens appended, samples forked, finished ones freed). Its
    limits are a ``minillm.core.config.SchedulerConfig``'s, checked there."""

    def __init__(self, allocator: KVAllocator, max_num_batched_tokens: int = 1024,
                 max_num_seqs: int = 64, policy: SchedulingPolicy | None = None,
                 eos_ids: set[int] = frozenset(),
                 max_model_len: int = 1 << 62, select_beams: SelectBeams = select_beams,
                 emit: Emit | None = None, controller: BatchController | None = None):
        """``select_beams`` makes each beam-search choice (the visualizer's replay passes one that
        replays a recorded search); ``emit(phase, request_id, data)`` tells the engine's observers
        (``runtime/observe.py``) of each choice made. The components a rung plugs in: ``policy``
        (``core/policy.py``; default FCFS) orders and may evict, ``controller``
        (``core/budget.py``; default the fixed limits) narrows the step's token budget."""
        if isinstance(policy, str):
            raise TypeError(f"policy={policy!r}: the scheduler takes a SchedulingPolicy "
                            "(core/policy.py); a policy's name is an engine option: "
                            f"create_engine('paged', model, policy={policy!r})")
        self.allocator = allocator
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy or FCFS()
        self.eos_ids, self.max_model_len = set(eos_ids), max_model_len
        self.groups: dict[str, SequenceGroup] = {}    # request id -> group, until it finishes
        self.select_beams = select_beams
        self.emit = emit or (lambda phase, request_id=None, data=None: None)
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.num_arrived = 0
        self.num_steps = 0                  # schedule() calls: the policy's clock
        self.controller = controller or FixedBatch()
        self.now_ms = 0.0                   # the step times told (observe_step): deadlines' clock

    def rank(self, g: SequenceGroup) -> tuple:
        """Sort key: who goes first, and (reversed) who is preempted first."""
        return self.policy.key(g)

    def add(self, req: Request) -> SequenceGroup:
        """Queue ``req`` at its rank: after the waiting groups whose key equals its own (arrival
        order among equals), with O(log n) key computations, never a sort of the whole queue (a
        10,000-line JSONL spent minutes re-sorting). ``self.waiting`` stays sorted by ``rank``
        because a waiting group's key never changes while it waits (``core/policy.py``).

        A request the policy cannot rank is a ``RequestError`` for it alone, before it joins the
        queue: left inside, its key would fail every later sort and every step, i.e. everyone's
        requests. ``priority`` is checked again here because callers assign it after the
        ``Request`` was made (the CLI, the server)."""
        if req.request_id in self.groups:
            raise RequestError(f"{req.request_id}: a request with this id is already in flight")
        group = SequenceGroup(req, [Sequence(req, list(req.prompt_token_ids), req.prompt_len)],
                              self.num_arrived, self.num_steps, self.now_ms)
        try:
            req.priority = check_field("priority", req.priority)
        except ValueError as e:
            raise RequestError(f"{req.request_id}: {e}") from None
        try:
            key = self.rank(group)
        except Exception as e:      # a policy's own bug (OverflowError, TypeError...): this one
            raise RequestError(f"{req.request_id}: the {self.policy.name!r} policy cannot rank "
                               f"this request ({type(e).__name__}: {e})") from None
        self.num_arrived += 1
        p = req.params                                # the arrival rate (rung 12)
        self.controller.arrived(self.now_ms, req.prompt_len + max(p.n, p.beam_width) * p.max_tokens)
        self.groups[req.request_id] = group
        self.waiting.insert(bisect.bisect_right(self.waiting, key, key=self.rank), group)
        return group

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, constraints: Constraints = NONE) -> SchedulerOutput:
        """Plan one step: running groups in rank order, then (unless one was preempted: memory
        is tight, let running requests finish) waiting ones, within the budget."""
        out = SchedulerOutput([], [], [])
        budget = self.step_budget()
        self.num_steps += 1
        self.running.sort(key=self.rank)
        for group in [g for g in self.running if g not in constraints.exclude]:
            if group not in self.running:       # preempted while making room for a better one
                continue
            budget = self._schedule_running(group, budget, out, constraints.exclude)
            if budget == 0:
                break
        if not out.preempted:
            budget = self._schedule_waiting(budget, out, constraints)
        return out

    def _schedule_running(self, group: SequenceGroup, budget: int, out: SchedulerOutput,
                          exclude: Collection[SequenceGroup] = ()) -> int:
        """Schedule one running group within ``budget``; return the budget left. Each sequence gets
        the tokens it still needs (``_num_to_compute``) once its slots are appended; while they
        cannot be, preempt the lowest-ranked running group not in ``exclude`` (the last of
        ``self.running``), until they can or the group itself was the victim. Beams and samples
        decode together or not at all."""
        if all(s.num_uncomputed == 1 for s in group.seqs) and len(group.seqs) > budget:
            return budget  # beams and samples decode together, or not at all this step
        self._readopt_prompt(group)
        for seq in group.seqs:
            num_new = self._num_to_compute(group, seq, budget)
            if num_new == 0:
                if budget == 0:
                    break
                continue       # done for now (a beam waiting for its siblings), or waiting to adopt
            while not self.allocator.can_append(seq, num_new):
                victim = self._lowest_ranked(exclude)
                self.preempt(victim, out)
                if victim is group:
                    return budget
            out.copies += self.allocator.append_slots(seq, num_new)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def step_budget(self) -> int:
        """The config's budget, or the controller's cap, never below the widest running request
        (its samples or beams decode together: none starves)."""
        cap = self.controller.cap
        if cap is None:
            return self.max_num_batched_tokens
        widest = max((len(g.seqs) for g in self.running), default=1)
        return min(self.max_num_batched_tokens, max(cap, widest, 1))

    def observe_step(self, num_tokens: int, step_ms: float) -> None:
        """A step took ``step_ms``: the clock moves on, the controller learns (and tells)."""
        self.now_ms += step_ms
        decision = self.controller.observe(num_tokens, step_ms)
        if decision is not None:
            self.emit("controlled", None, decision)

    def _lowest_ranked(self, exclude: Collection[SequenceGroup] = ()) -> SequenceGroup:
        """The running group to preempt first: the last in rank order that may be touched."""
        return next(g for g in reversed(self.running) if g not in exclude)

    def _schedule_waiting(self, budget: int, out: SchedulerOutput, c: Constraints) -> int:
        """Admit waiting groups in rank order while budget, ``max_num_seqs`` and free blocks last
        (and at most ``c.max_new`` of them, if given); return the budget left. A group that finds
        no seat, or none of whose tokens fit (``_plan``), may evict a running group the policy
        ranks below it (``_preempt_for``, never one in ``c.exclude``) and try again; otherwise
        nobody overtakes it. One that ``c.admit`` refuses is skipped (as in vLLM)."""
        admitted, at = 0, 0
        while at < len(self.waiting) and budget > 0 and \
                (c.max_new is None or admitted < c.max_new):
            group = self.waiting[at]
            if group in out.preempted:          # not re-admitted in the step it was preempted
                break
            if c.admit is not None and not c.admit(group):
                at += 1
                continue
            seated = len(self.running) < min(self.max_num_seqs, self.step_budget())
            planned = self._plan(group, budget, out) if seated else []
            if not planned:
                if not self._preempt_for(group, out, c.exclude):
                    break
                budget = self.step_budget() - out.num_tokens
                continue
            self.waiting.pop(at)
            self.running.append(group)
            admitted += 1
            out.scheduled += planned
            budget -= sum(n for _, n in planned)
        return budget

    def _plan(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> list:
        """A waiting group's (sequence, tokens) for this step, slots appended: it first adopts
        cached prefix blocks, then each sequence gets its tokens while blocks last. If none fit,
        the adopted prefix blocks are given back and the plan is empty."""
        leader = group.seqs[0]
        if not leader.block_table:
            self.allocator.allocate_cached_prefix(leader)
        self._readopt_prompt(group)
        planned = []
        for seq in group.seqs:
            num_new = self._num_to_compute(group, seq, budget - sum(n for _, n in planned))
            if num_new == 0:
                continue
            if not self.allocator.can_append(seq, num_new):
                break
            out.copies += self.allocator.append_slots(seq, num_new)
            planned.append((seq, num_new))
        if not planned:
            for seq in group.seqs:              # undo the prefix-cache adoption; try later
                self.allocator.free(seq)
        return planned

    def _preempt_for(self, group: SequenceGroup, out: SchedulerOutput,
                     exclude: Collection[SequenceGroup] = ()) -> bool:
        """Evict the lowest-ranked running group not in ``exclude`` for the waiting ``group``, if
        the policy says it may (``policy.preempts``); say whether it did (notebook 08)."""
        victims = [g for g in self.running if g not in exclude]
        if not victims:
            return False
        victim = max(victims, key=self.rank)
        if not self.policy.preempts(group, victim):
            return False
        self.preempt(victim, out)
        self.emit("preempted", victim.request.request_id, group.request.request_id)
        return True

    def _readopt_prompt(self, group: SequenceGroup) -> None:
        """After a preemption: once the first sequence has the prompt's K/V again, every sibling
        without blocks shares them (reference counts, no copy), exactly as when it was forked."""
        leader = group.seqs[0]
        if leader.num_computed_tokens < leader.prompt_len:
            return
        for seq in group.seqs[1:]:
            if not seq.block_table:
                self.allocator.share_prompt(leader, seq)

    def _num_to_compute(self, group: SequenceGroup, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` to compute this step, within ``budget``. While siblings wait to adopt
        the prompt, the first sequence stops at the prompt's end so they can share it."""
        if seq is not group.seqs[0]:
            if not seq.block_table:
                return 0                        # waits for the first sequence's prompt
        elif any(not s.block_table for s in group.seqs[1:]):
            return max(0, min(budget, seq.prompt_len - seq.num_computed_tokens))
        return min(seq.num_uncomputed + len(seq.spec_token_ids), budget)

    def preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Recompute preemption: drop all of the group's KV (every sequence freed, its tokens
        this step unscheduled, copies into its blocks dropped); its tokens stay, so nothing is lost
        but the work of computing them again. Counted in ``request.num_preemptions`` and
        ``self.num_preemptions``; the group goes back to the waiting queue at its rank (the front,
        among equals)."""
        self.running.remove(group)
        out.scheduled[:] = [(s, n) for s, n in out.scheduled if s not in group.seqs]
        dropped = {b for seq in group.seqs for b in seq.block_table}
        out.copies[:] = [(src, dst) for src, dst in out.copies if dst not in dropped]
        for seq in group.seqs:
            self.allocator.free(seq)
            seq.pending_logprobs = None         # a beam's logits are recomputed with its KV
        group.request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group)
        # before the waiting groups with an equal key (it arrived before them); its key may have
        # moved while it ran (score: fewer tokens remain), and stays put now that it waits
        at = bisect.bisect_left(self.waiting, self.rank(group), key=self.rank)
        self.waiting.insert(at, group)

    def finish(self, group: SequenceGroup) -> None:
        seqs = group.seqs + group.done_seqs       # its work: the prompt, every sample's output
        self.controller.finished(group.request.prompt_len + sum(len(s.output_token_ids)
                                                                for s in seqs))  # (rung 12)
        for seq in seqs:
            if seq.block_table:
                self.allocator.free(seq)
        if group in self.running:
            self.running.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)

    def live_seqs(self) -> list[Sequence]:
        """Sequences holding blocks right now (what memory snapshots draw)."""
        return [s for g in self.running + self.waiting for s in g.seqs if s.block_table]
