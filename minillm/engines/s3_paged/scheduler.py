"""The scheduler: each step, which sequences run and how many tokens each (notebook 03).

It is nothing but a token budget (vLLM v1's design). Each step may compute at most
``max_num_batched_tokens`` tokens for at most ``max_num_seqs`` requests:

1. running requests first — a decoding sequence needs 1 token, a sequence still in its prompt
   needs the rest of the prompt (or as much of it as the budget allows);
2. then waiting requests, in policy order, while budget, sequence slots and blocks last.

Chunked prefill falls out of the budget: a 2,000-token prompt with a 512-token budget simply
takes four steps, and decodes ride along in each of them instead of stalling.

When a running sequence needs a block and none is free, the scheduler *preempts* the
lowest-ranked running request (the newest, under FCFS): frees all its blocks and puts it back at
the front of the waiting queue, to be recomputed later from its tokens (recompute preemption).
The request being scheduled can always evict everyone ranked below it, and a request alone in
the pool always fits (checked on arrival), so this never deadlocks.

A preempted request with several sequences (n > 1 samples, beams) recomputes its prompt *once*:
its first sequence computes the prompt alone, then the others adopt those blocks (as the original
fork did) and compute only their own tokens. Recomputing each sample's prompt separately would need
more blocks than the request was admitted with, and could never fit a tight pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...request import Request
from .block_manager import BlockManager
from .sequence import Sequence

POLICIES = ("fcfs", "priority")


@dataclass(eq=False)
class SequenceGroup:
    """A request and its sequences (one, or n / beam_width after the prompt is done)."""

    request: Request
    seqs: list[Sequence]
    arrival_index: int
    done_seqs: list[Sequence] = field(default_factory=list)   # finished samples / beams

    def fork_samples(self, seq: Sequence, block_manager: BlockManager) -> list[Sequence]:
        """Once an ``n > 1`` request's prompt is computed, fork n - 1 more samples from it.

        The children share every prompt block (reference counts go up, nothing is copied); the
        first token each one appends into the shared last block triggers copy-on-write."""
        n = self.request.params.n
        if n == 1 or seq.num_tokens != seq.prompt_len:
            return []
        children = []
        for k in range(1, n):
            child = block_manager.fork(seq)
            child.sample_id = k
            children.append(child)
        self.seqs.extend(children)
        return children


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]       # (sequence, tokens to compute this step)
    copies: list[tuple[int, int]]               # copy-on-write block copies to do first
    preempted: list[SequenceGroup]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int = 1024,
                 max_num_seqs: int = 64, policy: str = "fcfs"):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.num_preemptions = 0

    def rank(self, g: SequenceGroup) -> tuple:
        """Sort key: who goes first, and (reversed) who is preempted first."""
        if self.policy == "priority":
            return (g.request.priority, g.arrival_index)
        return (g.arrival_index,)

    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)
        self.waiting.sort(key=self.rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        self.running.sort(key=self.rank)
        for group in list(self.running):
            if group not in self.running:       # preempted while making room for a better one
                continue
            budget = self._schedule_running(group, budget, out)
            if budget == 0:
                break
        if not out.preempted:                   # memory is tight: let running requests finish
            budget = self._schedule_waiting(budget, out)
        return out

    def _schedule_running(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int:
        if all(s.num_uncomputed == 1 for s in group.seqs) and len(group.seqs) > budget:
            return budget  # beams and samples decode together, or not at all this step
        self._readopt_prompt(group)
        for seq in group.seqs:
            num_new = self._num_to_compute(group, seq, budget)
            if num_new == 0:
                if budget == 0:
                    break
                continue       # done for now (a beam waiting for its siblings), or waiting to adopt
            while not self.bm.can_append(seq, num_new):
                victim = self.running[-1]
                self.preempt(victim, out)
                if victim is group:
                    return budget
            out.copies += self.bm.append_slots(seq, num_new)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            group = self.waiting[0]
            leader = group.seqs[0]
            if not leader.block_table:
                self.bm.allocate_cached_prefix(leader)
            self._readopt_prompt(group)
            planned = []
            for seq in group.seqs:
                num_new = self._num_to_compute(group, seq, budget - sum(n for _, n in planned))
                if num_new == 0:
                    continue
                if not self.bm.can_append(seq, num_new):
                    break
                out.copies += self.bm.append_slots(seq, num_new)
                planned.append((seq, num_new))
            if not planned:
                for seq in group.seqs:          # undo the prefix-cache adoption; try next step
                    self.bm.free(seq)
                break
            self.waiting.pop(0)
            self.running.append(group)
            out.scheduled += planned
            budget -= sum(n for _, n in planned)
        return budget

    def _readopt_prompt(self, group: SequenceGroup) -> None:
        """After a preemption: once the first sequence has the prompt's K/V again, every sibling
        without blocks shares them (reference counts, no copy), exactly as when it was forked."""
        leader = group.seqs[0]
        if leader.num_computed_tokens < leader.prompt_len:
            return
        for seq in group.seqs[1:]:
            if not seq.block_table:
                self.bm.share_prompt(leader, seq)

    def _num_to_compute(self, group: SequenceGroup, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` to compute this step, within ``budget``. While siblings wait to adopt
        the prompt, the first sequence stops at the prompt's end so they can share it."""
        if seq is not group.seqs[0]:
            if not seq.block_table:
                return 0                        # waits for the first sequence's prompt
        elif any(not s.block_table for s in group.seqs[1:]):
            return max(0, min(budget, seq.prompt_len - seq.num_computed_tokens))
        return min(seq.num_uncomputed, budget)

    def preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Recompute preemption: drop all of the group's KV; its tokens stay, so nothing is lost
        but the work of computing them again."""
        self.running.remove(group)
        out.scheduled[:] = [(s, n) for s, n in out.scheduled if s not in group.seqs]
        dropped = {b for seq in group.seqs for b in seq.block_table}
        out.copies[:] = [(src, dst) for src, dst in out.copies if dst not in dropped]
        for seq in group.seqs:
            self.bm.free(seq)
            seq.pending_logprobs = None         # a beam's logits are recomputed with its KV
        group.request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(group)
        self.waiting.insert(0, group)
        self.waiting.sort(key=self.rank)    # stable: ties keep the preempted group in front

    def finish(self, group: SequenceGroup) -> None:
        for seq in group.seqs + group.done_seqs:
            if seq.block_table:
                self.bm.free(seq)
        if group in self.running:
            self.running.remove(group)
        elif group in self.waiting:
            self.waiting.remove(group)
