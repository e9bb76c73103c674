"""Proposers: cheap guesses of a sequence's next k tokens (notebook 06).

Both sit behind one small interface, ``Proposer``:

* ``NgramProposer`` (prompt lookup): find the sequence's last n tokens earlier in its own prompt
  and output, and guess what followed them there. No model at all; it shines when the answer
  copies its input (editing, quoting, summarizing with the source's words, code).
* ``DraftModelProposer``: the target's first few layers plus its final norm and LM head — a
  smaller model with the same tokenizer, sharing the target's weight tensors (nothing copied,
  nothing downloaded): a ``ModelRunner`` over ``layers=range(k)`` of the target's net. It keeps
  its own paged KV: its own ``KVPool`` (those k layers) and its own ``BlockManager``,
  with a sequence per target sequence that catches up on tokens it has not seen and is
  truncated, like the target's, when guesses are rejected.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ...request import SamplingParams
from ...sampling import draw_uniform, sample_one
from ...core.block_manager import BlockManager
from ...core.runner import ModelRunner
from ...core.sequence import Sequence
from .rejection import full_probs


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], k: int | list[int]) -> list[list[int]]:
        """Up to ``k`` (one for all, or one per sequence) guessed next tokens for each sequence (possibly none)."""

    def proposal_probs(self, seq: Sequence) -> torch.Tensor | None:
        """The distributions the last guesses for ``seq`` were drawn from, ``[k, vocab]``, or
        None when they were certain or ``seq``'s request is seeded (only ``accept_sampled``, the
        unseeded rule, needs them)."""

    def reset(self) -> None:
        """Forget every sequence (the engine was reset)."""


class NgramProposer:
    """Prompt lookup: the longest suffix (``max_n`` down to ``min_n`` tokens) that occurred before,
    most recent occurrence first; propose the up to ``k`` tokens that followed it."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], k: int | list[int]) -> list[list[int]]:
        ks = [k] * len(seqs) if isinstance(k, int) else k
        return [self.lookup(s.token_ids, k_s) if k_s > 0 else [] for s, k_s in zip(seqs, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):   # newest occurrence first
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + k]
        return []

    def proposal_probs(self, seq: Sequence) -> None:
        return None

    def reset(self) -> None:
        pass


class DraftModelProposer:
    """k guesses from a truncated copy of the target, k small forwards per step for the batch."""

    def __init__(self, target: ModelRunner, num_layers: int, num_blocks: int):
        # The target's own net (the same weight tensors), run for its first ``num_layers``
        # layers only, then its final norm and head; the pool holds those layers' K/V, stored
        # as the target's are (kv_cache_dtype, rung 9).
        self.runner = ModelRunner(None, num_blocks, target.block_size, target.backend,
                                  net=target.net, layers=range(num_layers), device=target.device,
                                  dtype=target.pool.dtype, kv_format=target.pool.fmt)
        self.block_manager = BlockManager(num_blocks, target.block_size)
        self.seqs: dict[int, Sequence] = {}            # target seq_id -> the draft's own copy
        self.probs: dict[int, torch.Tensor] = {}       # target seq_id -> q of its last guesses

    def _sync(self, seq: Sequence) -> Sequence:
        """The draft's sequence for ``seq``: its tokens made equal to the target's, its KV kept for
        the common prefix only (rejected guesses rolled back), at least one token to compute."""
        d = self.seqs.get(seq.seq_id)
        if d is None:
            d = self.seqs[seq.seq_id] = Sequence(seq.request, [], seq.prompt_len)
        same = next((i for i, (a, b) in enumerate(zip(d.token_ids, seq.token_ids)) if a != b),
                    min(d.num_tokens, seq.num_tokens))
        self.block_manager.truncate(d, min(d.num_computed_tokens, same, seq.num_tokens - 1))
        d.token_ids = list(seq.token_ids)
        return d

    def _drop(self, seq_id: int) -> None:
        d = self.seqs.pop(seq_id, None)
        if d is not None:
            self.block_manager.free(d)
        self.probs.pop(seq_id, None)

    def propose(self, seqs: list[Sequence], k: int | list[int]) -> list[list[int]]:
        ks = [k] * len(seqs) if isinstance(k, int) else list(k)
        for sid in set(self.seqs) - {s.seq_id for s in seqs}:    # finished, preempted, paused
            self._drop(sid)
        synced = [(s, self._sync(s), k_s) for s, k_s in zip(seqs, ks)]   # rollbacks first
        active, reserved = [], 0
        for s, d, k_s in synced:
            # room for the catch-up and k - 1 guesses (the last guess is never run)
            need = self.block_manager.blocks_needed(d, d.num_uncomputed + k_s - 1)
            if k_s > 0 and reserved + need <= self.block_manager.num_free_blocks:
                active.append((s, d, k_s))
                reserved += need
            else:
                self._drop(s.seq_id)     # no room in the draft's pool: no guesses this step
        guesses = {s.seq_id: [] for s in seqs}
        rows: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s, _, _ in active}
        for j in range(max(ks, default=0)):
            active = [a for a in active if a[2] > j]
            if not active:
                break
            scheduled = [(d, d.num_uncomputed) for _, d, _ in active]
            for d, n in scheduled:
                self.block_manager.append_slots(d, n)
            reached, logits, _ = self.runner.run(scheduled)   # (no prompt logprobs here)
            row_of = {d.seq_id: i for i, d in enumerate(reached)}   # reached is in step order
            for (s, d, _), (_, n) in zip(active, scheduled):
                d.num_computed_tokens += n
                token, q = self._draw(logits[row_of[d.seq_id]], s.request.params,
                                      len(s.output_token_ids) + j, s.sample_id)
                d.token_ids.append(token)
                guesses[s.seq_id].append(token)
                if q is not None:
                    rows[s.seq_id].append(q)
        self.probs = {sid: torch.stack(r) for sid, r in rows.items() if r}
        return [guesses[s.seq_id] for s in seqs]

    @staticmethod
    def _draw(logits: torch.Tensor, p: SamplingParams, index: int,
              sample_id: int = 0) -> tuple[int, torch.Tensor | None]:
        """The draft's guess for output token ``index``: its argmax (greedy requests), else plain
        decoding's draw from its own filtered distribution q with the uniform the target draws
        that index with (``draw_uniform``). Seeded, that uniform is the request's: the two
        inverse-CDF draws, from q and from p, agree often when q is close to p, and the target keeps
        the guess iff they agree (``accept_seeded``). Unseeded, it is fresh entropy, and q comes
        back too: rejection sampling (``accept_sampled``) needs it."""
        if p.greedy:
            return int(logits.argmax()), None
        token = sample_one(logits.float(), p.temperature, p.top_k, p.top_p,
                           draw_uniform(p.seed, index, sample_id))
        return token, None if p.seed is not None else full_probs(logits, p)

    def proposal_probs(self, seq: Sequence) -> torch.Tensor | None:
        return self.probs.get(seq.seq_id)

    def reset(self) -> None:
        self.seqs.clear()
        self.probs.clear()
        self.block_manager.release_all()
