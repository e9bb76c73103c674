"""``ModelRunner``: owns a ``KVPool`` (kv_pool.py) and turns a scheduled step into one forward pass.

For each scheduled ``(sequence, num_new_tokens)`` it lays out the step's tokens flat (decodes
first, then prefill chunks) and builds what attention needs: ``positions``, the ``slot_mapping``
(where each new token's K/V go) and the block tables. Notebook 03 prints these for a small batch.
"""
from __future__ import annotations

import ctypes
import functools
import sys

import torch
from torch.profiler import record_function

from ..logprobs import TokenLogprobs, token_logprobs
from ..models import LoadedModel
from ..layers.attention.reference import AttentionMetadata
from .kv_pool import KVPool
from ..layers.kv_quant import FORMATS, KVCacheFormat
from .model import PagedLlama
from .sequence import Sequence

# (sequence, its first prompt token computed this step, one logprobs dict per token from there)
PromptLogprobs = tuple[Sequence, int, list[TokenLogprobs]]


def step_order(scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """The order a step's tokens are laid out in: decodes first, then prefill chunks."""
    return [(s, n) for s, n in scheduled if n == 1] + [(s, n) for s, n in scheduled if n > 1]


def reaching_end(order: list[tuple[Sequence, int]]) -> list[int]:
    """Indices in ``order`` of the sequences whose newest token is computed this step: they get
    logits (a middle chunk of a long prompt does not)."""
    return [k for k, (s, n) in enumerate(order)
            if s.num_computed_tokens + n == s.num_tokens + len(s.spec_token_ids)]


def prompt_rows(order: list[tuple[Sequence, int]], last: list[int]
                ) -> list[tuple[Sequence, int, list[int]]]:
    """(sequence, first prompt token, flat rows) of each chunk whose request asks
    ``prompt_logprobs`` and covers prompt positions whose next token has no logprob yet (a
    preempted request computing its prompt again asks none twice). Position p predicts token
    p + 1; the prompt's last position predicts the first output token (the sampler's row)."""
    out = []
    for k, (seq, n) in enumerate(order):
        known = seq.request.prompt_logprobs
        if known is None:
            continue
        start = seq.num_computed_tokens
        lo, hi = max(start, len(known) - 1), min(start + n, seq.prompt_len - 1)
        if lo < hi:
            row = last[k] - (n - 1)                    # the flat row of position ``start``
            out.append((seq, lo + 1, list(range(row + lo - start, row + hi - start))))
    return out


def pad_tables(tables: list[list[int]], device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32,
                        device=device).reshape(len(tables), width)


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for the next step instead of handing it back to the
    OS; True where it could (Linux with glibc), False elsewhere (nothing changes there).

    Each step allocates its activations afresh and frees them at its end; a 1024-token prefill
    step of SmolLM2 uses ~100 MiB of them. glibc serves blocks that big with mmap and unmaps them
    when freed, so every step writes to brand-new pages: ~25k page faults per such step, each
    one zeroing 4 KiB -- about 8% of the step on the lab CPU. With the mmap threshold at its
    largest (32 MiB) and the trim threshold high, the pages stay in the process and are reused:
    the same peak memory, no faults after the first step. This is a setting of the whole process
    (vLLM's CPU backend swaps in another allocator, tcmalloc, for the same reason)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and \
            bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):      # another libc (musl): leave its allocator alone
        return False


class ModelRunner:
    """Runs layers ``layers`` of ``net`` over its own ``KVPool`` (those layers' K/V only).

    Every runner is built here: rung 3's (the whole model, from ``model``), rung 6's draft (the
    target's ``net`` and its first k layers) and rung 7's stages (a slice) differ only in the
    arguments, never in how the pool is allocated."""

    def __init__(self, model: LoadedModel | None, num_blocks: int, block_size: int, backend, *,
                 net: PagedLlama | None = None, layers: range | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 linear_kernel=None, kv_format: KVCacheFormat = FORMATS["auto"], ops=None):
        """``kv_format``: how the pool stores K/V (rung 9's ``kv_cache_dtype``); ``net`` defaults to ``PagedLlama(model.hf_model, linear_kernel)`` (its weights, read
        once; ``linear_kernel``: see layers/linear.py),
        ``layers`` to all of them, ``device`` and ``dtype`` to the model's; without ``model``,
        give all three."""
        if model is None and (net is None or device is None or dtype is None):
            raise ValueError("ModelRunner needs a model, or net=, device= and dtype=")
        self.net = net if net is not None else PagedLlama(model.hf_model, linear_kernel, ops)
        self.layers = layers if layers is not None else range(len(self.net.layers))
        n = len(self.net.layers)
        if self.layers.step != 1 or not 0 <= self.layers.start <= self.layers.stop <= n:
            raise ValueError(f"layers must be a contiguous slice of the model's {n} layers, "
                             f"got {self.layers!r}")
        self.device = torch.device(device) if device is not None else model.device
        self.block_size = block_size
        self.backend = backend
        self.pool = KVPool(len(self.layers), num_blocks, block_size, self.net.num_kv_heads,
                           self.net.head_dim, dtype or model.dtype, self.device, kv_format)
        if self.device.type == "cpu":
            keep_freed_memory()

    @property
    def kv_caches(self) -> list[tuple]:
        """The pool's (k, v) per layer of ``layers``, as ``PagedLlama.forward`` takes them."""
        return self.pool.caches

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give a sequence its own copy of a block it shared before writing."""
        self.pool.copy_blocks(copies)

    def slot_mapping(self, seq: Sequence, start: int, n: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def split(self, scheduled: list[tuple[Sequence, int]]):
        """(decodes, prefills): which of a step's sequences attend as decode rows (each of their n
        tokens one row, its context ending at its own position) and which as prefill chunks.

        A verification (rung 6: the newest token and k guesses) is a decode too: token i of it
        attends to the cache up to its own position, whose K/V are written before attention
        reads them, so its 1 + k tokens become 1 + k decode rows sharing one block table and run
        in the batched decode attention beside the others, instead of one chunk per sequence
        (a gather and a mask each, per layer: slow for 64 sequences of 5 tokens)."""
        order = step_order(scheduled)
        verify = [(s, n) for s, n in order if n > 1 and s.spec_token_ids]
        return ([(s, n) for s, n in order if n == 1] + verify,
                [(s, n) for s, n in order if n > 1 and not s.spec_token_ids])

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Flatten a step into model inputs. Returns (input_ids, positions, meta, order, last)
        where ``order`` is the scheduled list in token order and ``last[i]`` is the flat index
        of ``order[i]``'s last token this step."""
        decodes, prefills = self.split(scheduled)
        order = decodes + prefills
        ids, pos, slots, last = [], [], [], []
        for seq, n in order:
            start = seq.num_computed_tokens
            ids += seq.input_ids(start, n)
            pos += range(start, start + n)
            slots += self.slot_mapping(seq, start, n)
            last.append(len(ids) - 1)
        rows = [(s.block_table, s.num_computed_tokens + i + 1) for s, n in decodes for i in range(n)]
        dev = self.device
        q_lens = [n for _, n in prefills]
        ctx_lens = [s.num_computed_tokens + n for s, n in prefills]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(rows),
            decode_block_tables=pad_tables([t for t, _ in rows], dev),
            decode_context_lens=torch.tensor([c for _, c in rows], dtype=torch.int32, device=dev),
            prefill_block_tables=pad_tables([s.block_table for s, _ in prefills], dev),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            prefill_q_lens=q_lens, prefill_ctx_lens=ctx_lens)
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta, order, last)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after ``layers`` (no final norm): ``x`` is token ids when they start at
        layer 0 (embedded first), the previous layers' hidden states otherwise (rung 7)."""
        h = self.net.embed_tokens(x) if self.layers.start == 0 else x
        return self.net.forward_layers(h, positions, meta, self.pool.caches, self.backend,
                                       self.layers.start, self.layers.stop)

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Sequence, int]]
            ) -> tuple[list[Sequence], torch.Tensor, list[PromptLogprobs]]:
        """One forward; returns the sequences that reached their newest token, their logits (one
        row each, or 1 + k consecutive rows for a sequence with k guesses (rung 6), the target's
        distribution after its newest token and after each guess) and the prompt logprobs of
        the chunks whose request asks ``prompt_logprobs`` (``prompt_logprobs``; usually none)."""
        ids, pos, meta, order, last = self.prepare(scheduled)
        with record_function("minillm::forward"):     # scopes for `make profile` (profile_step.py)
            hidden = self.net.final_hidden(self.forward(ids, pos, meta))
        prompt = self.prompt_logprobs(order, last, hidden)
        want = reaching_end(order)
        if not want:   # only middle chunks of long prompts: no next token yet
            return [], hidden.new_empty((0, self.net.vocab_size)), prompt
        idx = torch.tensor([i for k in want for i in
                            range(last[k] - len(order[k][0].spec_token_ids), last[k] + 1)],
                           device=self.device)
        with record_function("minillm::logits"):
            return [order[k][0] for k in want], self.net.logits(hidden[idx]), prompt

    def prompt_logprobs(self, order: list[tuple[Sequence, int]], last: list[int],
                        hidden: torch.Tensor) -> list[PromptLogprobs]:
        """(sequence, first prompt token, their logprobs) for each chunk whose request asks
        ``prompt_logprobs``: the logits at position p give token p + 1's. Only these rows get
        vocabulary-wide logits; every other row of the step keeps its hidden state only."""
        found = prompt_rows(order, last)
        if not found:
            return []
        rows = [r for _, _, rs in found for r in rs]
        chosen = [s.token_ids[first + j] for s, first, rs in found for j in range(len(rs))]
        ks = [s.request.params.prompt_logprobs for s, _, rs in found for _ in rs]
        with record_function("minillm::prompt_logprobs"):
            entries = token_logprobs(self.net.logits(hidden[rows]), chosen, ks)
        out, at = [], 0
        for seq, first, rs in found:
            out.append((seq, first, entries[at:at + len(rs)]))
            at += len(rs)
        return out
