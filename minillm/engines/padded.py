"""Shared by rungs 1 and 2: batching sequences of different lengths into one padded rectangle.

A batch of prompts with different lengths is *left*-padded so that every row's newest token sits in
the same (last) column; then one forward pass can append one new token to every row at once. The
attention mask hides the padding and ``position_ids`` count only real tokens, so each row computes
exactly what it would alone (up to fp32 rounding). Notebooks 01 and 02 draw this rectangle.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``input_ids`` and a 0/1 ``attention_mask``, both [len(seqs), longest]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def hf_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of the HF model over a padded batch; returns each row's last-position logits.

    Position ids count real tokens only (padding does not advance a row's position), which is what
    makes a padded row compute the same thing as the unpadded sequence.
    """
    if positions is None:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


class GrowableLayer(DynamicLayer):
    """One layer's K/V rectangle that grows like a Python list: it keeps spare columns, so adding
    a token writes in place. (HF's DynamicLayer does ``torch.cat`` — a copy of the whole cache at
    every decode step, which at batch 64 costs more than the attention itself.)"""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.assign(keys, values)

    def assign(self, keys: torch.Tensor, values: torch.Tensor, spare: int = 64) -> None:
        b, h, n, d = keys.shape
        self._k, self._v = keys.new_empty(b, h, n + spare, d), values.new_empty(b, h, n + spare, d)
        self._k[:, :, :n], self._v[:, :, :n] = keys, values
        self._len = n
        self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = key_states.shape[-2]
        if self._len + n > self._k.shape[-2]:   # out of room: double, like list.append
            self.assign(self.keys, self.values, spare=max(64, self._len))
        self._k[:, :, self._len:self._len + n] = key_states
        self._v[:, :, self._len:self._len + n] = value_states
        self._len += n
        self.keys, self.values = self._k[:, :, :self._len], self._v[:, :, :self._len]
        return self.keys, self.values


class PaddedKV:
    """The padded KV rectangle of rung 2: every layer's K and V are [rows, kv_heads, width, head_dim].

    ``mask[r, c]`` says whether column c of row r holds a real token. A row whose request has left is
    a *hole*: its memory stays allocated (all-False mask) until a newcomer takes it over or the
    rectangle is compacted.
    """

    def __init__(self, cache: DynamicCache, mask: torch.Tensor):
        cache.layers = [GrowableLayer(layer.keys, layer.values) for layer in cache.layers]
        self.cache, self.mask = cache, mask.bool()

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def _map(self, fn):
        for layer in self.cache.layers:
            layer.assign(fn(layer.keys), fn(layer.values))

    def select_rows(self, keep: list[int]) -> None:
        """Drop every row not in ``keep`` (compaction: costs a copy of the whole cache)."""
        idx = torch.tensor(keep, device=self.mask.device)
        self._map(lambda t: t.index_select(0, idx))
        self.mask = self.mask.index_select(0, idx)

    def trim_left(self) -> None:
        """Drop leading columns that are padding in every row (after the longest request left)."""
        used = self.mask.any(0)
        first = int(used.float().argmax()) if bool(used.any()) else self.width
        if first > 0:
            self._map(lambda t: t[:, :, first:])
            self.mask = self.mask[:, first:]

    def pad_left(self, n: int) -> None:
        if n > 0:
            self._map(lambda t: torch.nn.functional.pad(t, (0, 0, n, 0)))
            self.mask = torch.nn.functional.pad(self.mask, (n, 0))

    def merge(self, other: "PaddedKV", slots: list[int]) -> None:
        """Copy ``other``'s rows into row ``slots[i]`` (an existing hole, or ``rows`` to append).

        Both rectangles are first right-aligned: the narrower one gets left padding. This is the
        cost of contiguous KV: a short newcomer next to a long runner inherits its width.
        """
        self.pad_left(other.width - self.width)
        other.pad_left(self.width - other.width)
        append = [i for i, s in enumerate(slots) if s >= self.rows]
        reuse = [(i, s) for i, s in enumerate(slots) if s < self.rows]
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            merged = []
            for t, o in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                for i, s in reuse:
                    t[s] = o[i]
                merged.append(torch.cat([t, o[append]], dim=0) if append else t)
            if append:
                mine.assign(*merged)
        for i, s in reuse:
            self.mask[s] = other.mask[i]
        if append:
            self.mask = torch.cat([self.mask, other.mask[append]], dim=0)
