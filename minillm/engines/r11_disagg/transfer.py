"""The KV hand-off (notebook 11, exercise 11): which blocks move, how they travel, and what the
receiver allocates and writes; and what the two workers say to each other.

Rank 0 (the decode worker, which also owns every request) sends a ``Command``: prompts to
prefill, aborts, the prefilled requests it has room for (*pulls*) and the transfers that landed
(*acks*). The prefill worker answers at once with a ``Reply`` — the requests its last step
finished prefilling, a ``Handoff`` for each pull, followed by that request's blocks (every tensor
of its pool, K and V of every layer, scales too, at those blocks, as stored, as raw bytes) — and
then runs one prefill step.
Pull, not push: a prefilled request waits in the prefill worker's pool (holding its blocks, so its
scheduler admits fewer new prompts) until the decode pool has room — that is the back-pressure.

The hand-off itself, in four functions (exercise 11): the sender picks the blocks that hold the
prompt's K/V (``filled_blocks``) and sends each pool tensor's rows at those blocks as raw bytes
(``send_blocks``); the receiver knows the layout, so it knows how many bytes to expect
(``Handoff.nbytes``) and how to view them as tensors again (``recv_blocks``); then it allocates
blocks in its own pool for those tokens, writes the rows in and registers the full blocks in its
prefix cache (``install_blocks``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...core.block_manager import BlockManager, NoFreeBlocksError
from ...core.scheduler import Scheduler
from ...core.sequence import Sequence
from ...request import FinishReason, Request
from ...dist.comm import Comm

Layout = list[tuple[torch.dtype, torch.Size]]     # each pool tensor's dtype and one block's shape


@dataclass
class Command:
    new: list[tuple[str, list[int], int]] = field(default_factory=list)  # (id, ids, priority)
    aborts: list[str] = field(default_factory=list)
    pulls: list[str] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)
    snapshot: bool = False       # send a picture of the prefill pool (the dashboard watches)


@dataclass(frozen=True)
class Handoff:
    request_id: str
    num_tokens: int              # tokens whose K/V the blocks hold (the prompt but its last)
    num_blocks: int
    hashes: tuple                # prefix-cache hashes of its blocks on the prefill side (or None)

    def nbytes(self, layout: Layout) -> int:
        """The bytes this hand-off moves: its blocks' rows in every tensor of the pool (``layout``:
        each tensor's dtype and the shape of one block of it; K and V of every layer, and the
        scales of a quantized pool, each its own tensor)."""
        return sum(self.num_blocks * shape.numel() * torch.empty(0, dtype=dtype).element_size()
                   for dtype, shape in layout)


@dataclass
class Reply:
    ready: list[tuple[str, int]] = field(default_factory=list)   # newly prefilled: (id, tokens)
    sent: list[Handoff] = field(default_factory=list)            # their blocks follow, in order
    free_blocks: int = 0                                         # the prefill pool, now
    num_blocks: int = 0
    snapshot: object = None      # the prefill pool's MemorySnapshot, when the command asked


def pool_layout(tensors: list[torch.Tensor]) -> Layout:
    """Each pool tensor's dtype and shape of one block: both sides' must be equal."""
    return [(t.dtype, t.shape[1:]) for t in tensors]


def filled_blocks(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    """The blocks of ``block_table`` that hold the first ``num_tokens`` tokens' K/V, in order:
    what moves. The last of them may be partly filled (it moves whole); the blocks after it hold
    nothing yet and stay."""
    return list(block_table[:-(-num_tokens // block_size)])


def send_blocks(comm: Comm, dst: int, data: list[torch.Tensor]) -> None:
    """Every tensor as raw bytes (gloo carries no fp8 or bf16; bytes are bytes)."""
    for t in data:
        comm.isend(t.contiguous().view(torch.uint8).reshape(-1), dst)


def recv_blocks(comm: Comm, src: int, num_blocks: int, layout: Layout) -> list[torch.Tensor]:
    """``send_blocks``' messages, one per pool tensor in ``layout``'s order: receive each as
    ``uint8`` bytes (``comm.recv(shape, dtype, src, what="recv")``: exactly its bytes, no more)
    and view them as ``num_blocks`` blocks of that tensor's dtype and block shape."""
    out = []
    for dtype, shape in layout:
        nbytes = num_blocks * shape.numel() * torch.empty(0, dtype=dtype).element_size()
        raw = comm.recv((nbytes,), torch.uint8, src, what="recv")
        out.append(raw.view(dtype).view(num_blocks, *shape))
    return out


def install_blocks(block_manager: BlockManager, pool, seq: Sequence, num_tokens: int,
         data: list[torch.Tensor]) -> list[int] | None:
    """The receiver's half: blocks in this pool for ``seq``'s first ``num_tokens`` tokens
    (``BlockManager.allocate_loaded``: they count as computed), the moved rows written into them
    (``pool.write_blocks``), and its full blocks registered in this side's prefix cache
    (``cache_full_blocks``). Returns the blocks; None when the pool has no room for them
    (nothing allocated: the request then computes its prompt here)."""
    try:
        blocks = block_manager.allocate_loaded(seq, num_tokens)
    except NoFreeBlocksError:
        return None
    pool.write_blocks(blocks, data)
    block_manager.cache_full_blocks(seq)
    return blocks


def make_room_for_head(scheduler: Scheduler) -> None:
    """Free the blocks waiting groups hold behind the queue's head, lowest-ranked first, until the
    head's uncomputed tokens fit; those groups recompute them when admitted. Only this rung lands
    KV into waiting groups (the engine's ``_idle``): in the core a waiting group holds no blocks
    but the prefix it adopts while being admitted."""
    allocator, head = scheduler.allocator, scheduler.waiting[0].seqs[0]
    for group in reversed(scheduler.waiting[1:]):
        if allocator.blocks_needed(head, head.num_uncomputed) <= allocator.num_free_blocks:
            return
        for seq in group.seqs:
            if seq.block_table:
                allocator.free(seq)


def end_unadmitted(req: Request, reason: FinishReason) -> Request:
    """End a request the decode side's scheduler never admitted (one still on the prefill worker,
    or its blocks on the way) as ``finish_group`` ends one: its one sample, with whatever tokens
    it has."""
    req.set_final([(list(req.output_token_ids), reason)])
    req.finish(reason)
    return req
