"""The block manager: KV memory as fixed-size blocks, handed out on demand (notebook 03).

A sequence's KV lives in blocks of ``block_size`` token slots listed by its ``block_table``; a new
block is taken only when the last one is full, so at most ``block_size - 1`` slots per sequence are
ever wasted, and a finished sequence's blocks go back to the pool at once.

Blocks are shared, never copied, when contents are the same:

* ``fork`` (parallel sampling, beam search): the child lists the parent's blocks; each block's
  ``ref_count`` says how many sequences use it. Writing into a shared block first copies it
  (copy-on-write): ``append_slots`` returns the (src, dst) pairs the engine must copy.
* prefix caching: a full block is identified by a chained hash of (parent block's hash, its token
  ids), so equal hashes mean equal *prefixes*, not just equal blocks. A new sequence whose prompt
  starts with cached blocks reuses them and skips their computation. A freed block keeps its
  contents and hash until it is needed for something else; the free queue hands out the least
  recently freed block first (LRU eviction).
"""
from __future__ import annotations


from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

from ..memory import KVCounts, MemorySnapshot, paged_snapshot
from ..request import Request
from .sequence import Sequence

BlockKey = tuple  # (parent hash, token ids of the block): the content a hash stands for


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None        # set once the block is full and its K/V computed
    key: BlockKey | None = None    # kept to guard against hash collisions


class NoFreeBlocksError(RuntimeError):
    pass


def blocks_for_request(prompt_len: int, num_output_tokens: int, width: int, block_size: int) -> int:
    """The most blocks one request can hold at once when it runs alone: the prompt's blocks, plus
    for each of ``width`` samples or beams its output's blocks and one copied-on-write block (the
    prompt's shared last block). A request that fits the pool alone always finishes, since
    preemption can evict everyone else and a preempted group re-shares its prompt."""
    def cdiv(a: int) -> int:
        return -(-a // block_size)
    if width == 1:
        return cdiv(prompt_len + num_output_tokens)
    return cdiv(prompt_len) + width * (cdiv(num_output_tokens) + 1)


class BlockManager:
    """The paged allocator behind ``minillm.engines.r5_allocators.KVAllocator``: the interface the scheduler
    drives (the visualizer's contiguous allocators implement the same one). Its geometry is a
    ``minillm.core.config.CacheConfig``'s, checked there."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        """A block's hash chain starts from its request's ``cache_salt`` (what its K/V depend on
        besides its tokens; None for most): requests with different salts never share a block."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front = least recently freed). An OrderedDict gives O(1)
        # removal from the middle, needed when a prefix-cache hit revives a free block.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}    # hash -> block id
        self.prefix_hits = 0                # tokens served from the prefix cache

    # --- the pool -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def _take_free(self) -> int:
        if not self.free_queue:
            raise NoFreeBlocksError("KV pool exhausted")
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:          # evict: its cached contents are about to be replaced
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash = block.key = None
        block.ref_count = 1
        return bid

    def _release(self, bid: int) -> None:
        """Drop one reference to block ``bid``; at zero it joins the back of the free queue (evicted
        last; with prefix caching its contents stay reusable until then)."""
        block = self.blocks[bid]
        assert block.ref_count > 0, f"block {bid} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[bid] = None     # most recently freed: evicted last

    # --- sequences ----------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks ``append_slots`` would take (a copy-on-write counts as one)."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        need = max(0, total - len(seq.block_table))
        if self._needs_cow(seq, num_new_tokens):
            need += 1
        return need

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def _needs_cow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Writing into a block that another sequence holds, or that the prefix cache lists under
        other contents, must not change it for them: copy it first."""
        if num_new_tokens == 0 or seq.num_computed_tokens % self.block_size == 0:
            return False
        last = self.blocks[seq.block_table[seq.num_computed_tokens // self.block_size]]
        return last.ref_count > 1 or last.hash is not None

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next ``num_new_tokens`` K/V rows; return copy-on-write (src, dst)."""
        if not self.can_append(seq, num_new_tokens):
            raise NoFreeBlocksError(f"need {self.blocks_needed(seq, num_new_tokens)} blocks, "
                                    f"{self.num_free_blocks} free")
        copies = []
        if self._needs_cow(seq, num_new_tokens):
            idx = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[idx], self._take_free()
            self._release(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take_free())
        return copies

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def fork(self, parent: Sequence) -> Sequence:
        """A child sharing every block of ``parent``: one more reference each, nothing copied until
        someone writes into a shared block (``append_slots``)."""
        child = parent.fork()
        for bid in child.block_table:
            self.blocks[bid].ref_count += 1
        return child

    def share_prompt(self, src: Sequence, dst: Sequence) -> None:
        """``dst`` (no blocks yet) shares the blocks of ``src`` that hold the common prompt, and
        starts with the prompt computed. Its first own token lands in the shared last prompt block
        (when the prompt does not end on a block boundary) and copies it on write."""
        assert not dst.block_table and src.num_computed_tokens >= src.prompt_len == dst.prompt_len
        dst.block_table = src.block_table[:-(-src.prompt_len // self.block_size)]
        for bid in dst.block_table:
            self.blocks[bid].ref_count += 1
        dst.num_computed_tokens = src.prompt_len
        dst.num_cached_tokens = min(src.num_cached_tokens, src.prompt_len)

    def free(self, seq: Sequence) -> None:
        """Give back one reference to each of ``seq``'s blocks, last block first; afterwards it
        holds none and has no K/V: ``num_computed_tokens`` and ``num_cached_tokens`` are 0 (a
        preempted sequence is recomputed from its tokens; stale counts would make the engine skip
        them and read K/V that is gone)."""
        # Tail first: the prompt's prefix blocks then sit at the back of the free queue and are
        # evicted last, since they are the likeliest to be reused.
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the K/V of ``seq``'s first ``num_tokens`` positions only: speculative decoding's
        rollback of rejected guesses (rung 6, notebook 06). Blocks wholly past them go back to the
        pool at once (one reference each: a block another sequence shares stays theirs); the
        partial last block is kept, and its slots past ``num_tokens`` are overwritten by the next
        tokens. That block is written again only if this sequence alone holds it and it is not in
        the prefix cache: otherwise ``append_slots`` copies it first, as for any shared block."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) \
                or not 0 <= num_tokens <= len(seq.block_table) * self.block_size:
            raise ValueError(f"num_tokens must be an int in [0, {len(seq.block_table) * self.block_size}]"
                             f" (the slots seq {seq.seq_id} holds), got {num_tokens!r}")
        keep = -(-num_tokens // self.block_size)
        for bid in reversed(seq.block_table[keep:]):    # tail first, as ``free`` does
            self._release(bid)
        del seq.block_table[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_tokens)

    def capacity_error(self, req: Request, longest: int) -> str | None:
        """Why ``req`` (at most ``longest`` tokens per sequence) could never run, even alone in
        the pool; None when it fits."""
        p, bs = req.params, self.block_size
        need = blocks_for_request(req.prompt_len, longest - req.prompt_len,
                                  max(p.n, p.beam_width), bs)
        if need > self.num_blocks:
            return (f"needs {need} KV blocks of {bs} tokens (prompt {req.prompt_len} + max_tokens "
                    f"{p.max_tokens}), but the whole pool has {self.num_blocks}")
        return None

    def release_all(self) -> None:
        """Every block back to the pool, for an engine reset when no sequence may hold anything
        any more. The prefix cache survives unless a block was still held (an interrupted step):
        then nothing in it can be trusted and it is emptied too."""
        if self.num_free_blocks == self.num_blocks:
            return
        for b in self.blocks:
            b.ref_count, b.hash, b.key = 0, None, None
        self.free_queue = OrderedDict((i, None) for i in range(self.num_blocks))
        self.cached.clear()

    # --- prefix caching -------------------------------------------------------------------------
    def _keys(self, token_ids: list[int], num_blocks: int, seed: Hashable = None):
        """(hash, key) of each of the first ``num_blocks`` full blocks, chained from ``seed``."""
        parent = seed
        for i in range(num_blocks):
            key = (parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            parent = hash(key)
            yield parent, key

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks yet, adopt the cached blocks its tokens start with.

        The last token is never taken from the cache: the model must run at least one token to
        produce logits for the next one. Returns the number of tokens that hit the cache.
        """
        assert not seq.block_table, "prefix lookup is only for a sequence's first allocation"
        if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return 0      # prompt logprobs need every prompt position's logits: none cached
        for h, key in self._keys(seq.token_ids, (seq.num_tokens - 1) // self.block_size,
                                 seq.request.cache_salt):
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].key != key:   # miss, or a hash collision
                break
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_queue[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        hit = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = hit
        self.prefix_hits += hit
        return hit

    def allocate_loaded(self, seq: Sequence, num_tokens: int) -> list[int]:
        """For a sequence with no blocks yet: blocks for its first ``num_tokens`` tokens, whose K/V
        another engine computed and is handing over (rung 11's KV transfer writes them in with
        ``KVPool.write_blocks``); they count as computed. Returns the blocks, in order."""
        assert not seq.block_table, "a transfer lands only in a sequence's first allocation"
        self.append_slots(seq, num_tokens)
        seq.num_computed_tokens = num_tokens
        return list(seq.block_table)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block the sequence has completely computed (called after each step)."""
        if not self.enable_prefix_caching:
            return
        # num_computed_tokens may run ahead of the tokens by this step's guesses (rung 6)
        full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        for i, (h, key) in enumerate(self._keys(seq.token_ids, full, seq.request.cache_salt)):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.key = h, key
                self.cached[h] = block.block_id

    # --- reporting ------------------------------------------------------------------------------
    def counts(self, seqs: list[Sequence], bytes_per_slot: int = 1,
               head: Request | None = None) -> KVCounts:
        """Slots by kind, as ``snapshot`` draws them (a shared block's tokens counted once).
        ``head`` (the request first in the waiting queue) does not matter: any free block is as
        good as any other, so paged memory has no external fragmentation."""
        fill = self._fill(seqs)
        bs = self.block_size
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        cached = len(self.cached_blocks())
        tokens = int(sum(fill.values()))
        return KVCounts(token=tokens, internal=used * bs - tokens,
                        free=(self.num_free_blocks - cached) * bs, cached=cached * bs,
                        bytes_per_slot=bytes_per_slot)

    def _fill(self, seqs: list[Sequence]) -> dict[int, int]:
        """Slots holding a computed token, per used block (shared blocks counted once)."""
        fill: dict[int, int] = {}
        for s in seqs:
            for i, bid in enumerate(s.block_table):
                n = min(self.block_size, max(0, s.num_computed_tokens - i * self.block_size))
                fill[bid] = max(fill.get(bid, 0), n)
        return fill

    def ref_counts(self) -> list[int]:
        """How many sequences hold each block, by block id."""
        return [b.ref_count for b in self.blocks]

    def cached_blocks(self) -> list[int]:
        """Free blocks whose contents the prefix cache keeps (reusable until evicted)."""
        return [b.block_id for b in self.blocks if b.ref_count == 0 and b.hash is not None]

    def snapshot(self, seqs: list[Sequence], engine: str, step: int, bytes_per_slot: int,
                 head: Request | None = None) -> MemorySnapshot:
        """The pool as a grid, one row per physical block (drawn by ``memory.paged_snapshot``)."""
        return paged_snapshot(engine, step, bytes_per_slot, self.block_size, self.ref_counts(),
                              self.cached_blocks(),
                              [(s.request.request_id, s.seq_id, s.block_table) for s in seqs],
                              self._fill(seqs))
