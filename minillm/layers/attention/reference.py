"""Paged attention, reference version in plain torch (notebook 03_block_manager).

The KV cache of one layer is two pools, ``k_cache`` and ``v_cache``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's tokens live in the blocks its
``block_table`` lists, in order: token ``i`` is at block ``block_table[i // block_size]``, offset
``i % block_size``. Physically the blocks can be anywhere in the pool.

Every backend implements three operations (rung 4's Triton kernels implement the same three):

* ``write_kv``: scatter this step's new K/V rows into their slots (``slot_mapping[t]`` =
  ``block * block_size + offset`` for new token t);
* ``decode``: one query token per sequence attends to its whole context through its block table;
* ``extend``: a chunk of new tokens per sequence (a prompt, or a piece of one) attends causally to
  itself and to the sequence's already-cached tokens (prefix caching, chunked prefill).

Tokens of a step are laid out flat: the ``num_decode`` decode tokens first, then each prefill
chunk in turn (``cu_seqlens_q`` marks where each chunk starts among the prefill tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about one engine step (vLLM calls this the context)."""

    slot_mapping: torch.Tensor            # [T] int64: where each new token's K/V goes
    num_decode: int                       # the first num_decode tokens are one-token decodes
    decode_block_tables: torch.Tensor     # [num_decode, max_blocks] int32 (-1 = unused)
    decode_context_lens: torch.Tensor     # [num_decode] int32: tokens in KV, the new one included
    prefill_block_tables: torch.Tensor    # [num_prefill_seqs, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor    # [num_prefill_seqs + 1] int32, offsets into prefill tokens
    prefill_context_lens: torch.Tensor    # [num_prefill_seqs] int32: cached + new tokens
    prefill_q_lens: list[int]             # python copies, so the torch path needs no .item()
    prefill_ctx_lens: list[int]


class TorchAttention:
    """The reference: gather each sequence's blocks into a contiguous tensor, then ordinary SDPA."""

    name = "torch"

    def __init__(self):
        self._decode_memo = None     # (block_tables, context_lens, slots, bias) of the last step

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter this step's new K/V rows [T, kv_heads, head_dim] into the pools
        [num_blocks, block_size, kv_heads, head_dim]: row t goes to flat slot ``slot_mapping[t]``
        (= block * block_size + offset)."""
        nkv, d = k.shape[1], k.shape[2]
        k_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, nkv, d).index_copy_(0, slot_mapping, v)

    @staticmethod
    def gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
        """[B, max_blocks] block tables -> [B, length, kv_heads, head_dim] contiguous KV."""
        nblocks = (length + cache.shape[1] - 1) // cache.shape[1]
        blocks = cache[block_tables[:, :nblocks].clamp(min=0).long()]   # [B, nb, bs, kvh, d]
        return blocks.flatten(1, 2)[:, :length]

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D] -> [B, H, D]; sequence b attends to its first context_lens[b] tokens, the
        scores scaled by ``scale`` (the model's, which need not be 1/√D)."""
        slots, bias = self.decode_index(block_tables, context_lens, k_cache.shape[1], q.dtype)
        B, H, D = q.shape
        kvh = k_cache.shape[2]
        # One index_select per pool reads every sequence's K/V rows in order: [B, L, kvh, D].
        k = k_cache.view(-1, kvh, D).index_select(0, slots.view(-1)).view(B, -1, kvh, D)
        v = v_cache.view(-1, kvh, D).index_select(0, slots.view(-1)).view(B, -1, kvh, D)
        # Grouped-query heads without copying K/V: the g query heads that share a KV head become
        # g query rows of that head ([B, kvh, g, D] against [B, kvh, L, D]).
        out = F.scaled_dot_product_attention(q.view(B, kvh, H // kvh, D), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=bias, scale=scale)
        return out.reshape(B, H, D)

    def decode_index(self, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     block_size: int, dtype: torch.dtype = torch.float32
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat slot of every context position of every sequence [B, L], and the additive
        mask hiding positions past each sequence's length [B, 1, 1, L]. Every layer of a step
        gets the same block tables, so this is built once per step: it is kept with the tensors
        it was built from (held, so a later step's tensors can never be mistaken for them)."""
        memo = self._decode_memo
        if memo is not None and memo[0] is block_tables and memo[1] is context_lens:
            return memo[2], memo[3]
        length = int(context_lens.max()) if context_lens.numel() else 0
        pos = torch.arange(length, device=block_tables.device)
        table = block_tables.long().clamp(min=0)
        slots = table[:, pos // block_size] * block_size + pos % block_size
        bias = torch.zeros(len(context_lens), 1, 1, length, device=block_tables.device,
                           dtype=dtype)
        bias.masked_fill_(pos[None, None, None, :] >= context_lens[:, None, None, None], float("-inf"))
        self._decode_memo = (block_tables, context_lens, slots, bias)
        return slots, bias

    def extend(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """q [T, H, D] (all prefill chunks, flat) -> [T, H, D]."""
        out = torch.empty_like(q)
        start = 0
        for s, (qlen, ctx) in enumerate(zip(meta.prefill_q_lens, meta.prefill_ctx_lens)):
            qs = q[start:start + qlen].transpose(0, 1)[None]              # [1, H, qlen, d]
            # Nothing cached before this chunk: its own K/V are the context, as the pool gives
            # them back (a narrower pool, rung 9, rounds them: ``stored``), so a prompt sees the
            # same K/V whether it is prefilled in chunks or not -- without reading the pool.
            if ctx == qlen:
                k = stored(k_cache, k_new[start:start + qlen])
                v = stored(v_cache, v_new[start:start + qlen])
                mask, causal = None, True
            else:             # attend to the cached prefix too, read through the block table
                table = meta.prefill_block_tables[s:s + 1]
                k, v = self.gather(k_cache, table, ctx)[0], self.gather(v_cache, table, ctx)[0]
                # query i sits at absolute position ctx - qlen + i and sees keys 0..that position
                pos_q = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
                mask, causal = torch.arange(ctx, device=q.device)[None, :] <= pos_q, False
            o = F.scaled_dot_product_attention(qs, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                               attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=True)
            out[start:start + qlen] = o[0].transpose(0, 1)
            start += qlen
        return out


def stored(pool, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as ``pool`` returns them once written: themselves in a pool of the model's dtype,
    rounded (and scaled) by a narrower one's own ``stored`` (rung 9's QuantizedPool)."""
    return rows if isinstance(pool, torch.Tensor) else pool.stored(rows)


def paged_attention(backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """One layer's attention for a whole step: write new K/V, then decode part and prefill part."""
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode
    if nd == q.shape[0]:
        return backend.decode(q, k_cache, v_cache, meta.decode_block_tables,
                              meta.decode_context_lens, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = backend.decode(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                  meta.decode_context_lens, scale)
    out[nd:] = backend.extend(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta, scale)
    return out
