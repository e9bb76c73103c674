"""What the two workers say to each other, once per step (notebook 11).

Rank 0 (the decode worker, which also owns every request) sends a ``Command``: prompts to
prefill, aborts, the prefilled requests it has room for (*pulls*) and the transfers that landed
(*acks*). The prefill worker answers at once with a ``Reply`` — the requests its last step
finished prefilling, a ``Handoff`` for each pull, followed by that request's blocks (every tensor
of its pool, K and V of every layer, scales too, at those blocks, as stored, as raw bytes) — and
then runs one prefill step.
Pull, not push: a prefilled request waits in the prefill worker's pool (holding its blocks, so its
scheduler admits fewer new prompts) until the decode pool has room — that is the back-pressure.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..r7_pipeline.comm import Comm


@dataclass
class Command:
    new: list[tuple[str, list[int], int]] = field(default_factory=list)  # (id, ids, priority)
    aborts: list[str] = field(default_factory=list)
    pulls: list[str] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Handoff:
    request_id: str
    num_tokens: int              # tokens whose K/V the blocks hold (the prompt but its last)
    num_blocks: int
    hashes: tuple                # prefix-cache hashes of its blocks on the prefill side (or None)

    def nbytes(self, layout: list[tuple[torch.dtype, torch.Size]]) -> int:
        return sum(self.num_blocks * shape.numel() * torch.empty(0, dtype=dtype).element_size()
                   for dtype, shape in layout)


@dataclass
class Reply:
    ready: list[tuple[str, int]] = field(default_factory=list)   # newly prefilled: (id, tokens)
    sent: list[Handoff] = field(default_factory=list)            # their blocks follow, in order
    free_blocks: int = 0                                         # the prefill pool, now
    num_blocks: int = 0


def pool_layout(tensors: list[torch.Tensor]) -> list[tuple[torch.dtype, torch.Size]]:
    """Each pool tensor's dtype and shape of one block: both sides' must be equal."""
    return [(t.dtype, t.shape[1:]) for t in tensors]


def send_blocks(comm: Comm, dst: int, data: list[torch.Tensor]) -> None:
    """Every tensor as raw bytes (gloo carries no fp8 or bf16; bytes are bytes)."""
    for t in data:
        comm.isend(t.contiguous().view(torch.uint8).reshape(-1), dst)


def recv_blocks(comm: Comm, src: int, num_blocks: int,
                layout: list[tuple[torch.dtype, torch.Size]]) -> list[torch.Tensor]:
    out = []
    for dtype, shape in layout:
        nbytes = num_blocks * shape.numel() * torch.empty(0, dtype=dtype).element_size()
        raw = comm.recv((nbytes,), torch.uint8, src, what="recv")
        out.append(raw.view(dtype).view(num_blocks, *shape))
    return out
