"""Exercise 11 — the KV hand-off of prefill/decode disaggregation, in
``minillm/engines/r11_disagg/transfer.py``: ``filled_blocks`` (which blocks move),
``Handoff.nbytes`` and ``recv_blocks`` (how many bytes arrive and how the receiver reads them back
as tensors), ``land`` (what the receiver allocates and writes).

Graded in one process first: the blocks against the definition (the first ceil(n / block_size)),
the bytes against the real pools' tensors (fp32, int8 with its scales, bf16, fp8), a round trip
through an in-memory link that holds ``recv_blocks`` to exactly the bytes each message carries,
and ``land`` on a real block manager and pool (blocks, computed tokens, the rows written, the
prefix cache, and nothing allocated when there is no room). Then end to end: the disagg engine
(rank 0 runs your file; the spawned prefill worker the package's) must give the paged engine's
tokens and leave both pools full, with an int8 cache and with prefix caching on.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import SamplingParams
from minillm.core.engine import PagedEngine
from minillm.engines.r11_disagg.transfer import (Handoff, filled_blocks, land, pool_layout,
                                                 recv_blocks, send_blocks)
from minillm.request import Request

FORMATS = ("auto", "int8", "bfloat16", "fp8")


@settings(max_examples=200, deadline=None)
@given(block_size=st.integers(1, 8), table=st.lists(st.integers(0, 999), min_size=1, max_size=12,
                                                     unique=True), data=st.data())
def test_filled_blocks_are_those_that_hold_the_tokens(block_size, table, data):
    n = data.draw(st.integers(1, len(table) * block_size))
    want = table[:-(-n // block_size)]             # the last one may be partly filled
    got = filled_blocks(list(table), n, block_size)
    assert list(got) == want, (f"{n} tokens in blocks of {block_size}, table {table}: the "
                               f"blocks holding them are {want}, got {list(got)}")


def engine(tiny, fmt="auto", **options):
    opts = dict(block_size=4, num_blocks=16, attention_backend="torch") | options
    return PagedEngine(tiny, kv_cache_dtype=fmt, **opts)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nbytes_counts_every_tensor_of_the_pool(tiny, fmt):
    pool = engine(tiny, fmt).runner.pool
    layout = pool_layout(pool.tensors())
    for n in (1, 3, 16):
        rows = pool.read_blocks(list(range(n)))          # what a transfer of n blocks sends
        want = sum(t.numel() * t.element_size() for t in rows)
        got = Handoff("r", n * 4, n, ()).nbytes(layout)
        assert got == want, (f"kv_cache_dtype={fmt}, {n} blocks: {want} bytes move (every "
                             f"tensor of the pool, K and V of each layer, scales too), got {got}")


class Link:
    """An in-memory link: ``isend`` queues a message, ``recv`` takes the next one, which must
    be exactly what it asks for (as gloo's would: a receive of the wrong size is an error)."""

    def __init__(self):
        self.messages: list[torch.Tensor] = []

    def isend(self, tensor, dst, tag=0):
        self.messages.append(tensor.clone())

    def recv(self, shape, dtype, src, tag=0, what="recv", microbatch=-1, timeout_s=None):
        assert self.messages, "recv_blocks asked for more messages than send_blocks sent"
        msg = self.messages.pop(0)
        assert dtype == torch.uint8 and tuple(shape) == tuple(msg.shape), (
            f"recv_blocks asked for a {tuple(shape)} {dtype} tensor; the message on the wire is "
            f"{tuple(msg.shape)} uint8 bytes (each pool tensor's bytes, flat)")
        return msg


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def as_bytes(tensors):
    return [t.contiguous().view(torch.uint8) for t in tensors]


@pytest.mark.parametrize("fmt", FORMATS)
def test_recv_blocks_reads_back_exactly_what_was_sent(tiny, fmt):
    pool = engine(tiny, fmt).runner.pool
    fill(pool, seed=11)
    layout = pool_layout(pool.tensors())
    sent = pool.read_blocks([5, 2, 9])
    link = Link()
    send_blocks(link, 0, sent)
    got = recv_blocks(link, 1, 3, layout)
    assert not link.messages, "recv_blocks left messages on the wire"
    assert len(got) == len(sent), f"{len(sent)} tensors were sent, {len(got)} read"
    for a, b in zip(got, sent):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"a tensor read back as {tuple(a.shape)} {a.dtype}; it was sent as "
            f"{tuple(b.shape)} {b.dtype}")
    assert all(torch.equal(x, y) for x, y in zip(as_bytes(got), as_bytes(sent))), \
        f"kv_cache_dtype={fmt}: the bytes read back differ from those sent"


def waiting_seq(eng, prompt):
    return eng.scheduler.add(Request(prompt, SamplingParams(max_tokens=3))).seqs[0]


@pytest.mark.parametrize("fmt", ("auto", "int8"))
def test_land_allocates_writes_and_caches(tiny, fmt):
    sender, receiver = engine(tiny, fmt), engine(tiny, fmt, enable_prefix_caching=True)
    fill(sender.runner.pool, seed=12)
    bm, pool = receiver.block_manager, receiver.runner.pool
    for n in (9, 8, 1):                  # a partly filled last block, full blocks, one token
        data = sender.runner.pool.read_blocks(list(range(-(-n // 4))))
        seq = waiting_seq(receiver, list(range(10 * n, 11 * n + 1)))   # (nothing cached yet)
        free = bm.num_free_blocks
        blocks = land(bm, pool, seq, n, data)
        assert blocks is not None and list(blocks) == seq.block_table, \
            "land returns the blocks it gave the sequence (its block table)"
        assert len(blocks) == len(data[0]) and bm.num_free_blocks == free - len(blocks), \
            f"{n} tokens need {len(data[0])} blocks; the pool lost {free - bm.num_free_blocks}"
        assert seq.num_computed_tokens == n, \
            f"the {n} moved tokens count as computed, got num_computed_tokens={seq.num_computed_tokens}"
        assert all(torch.equal(x, y) for x, y in
                   zip(as_bytes(pool.read_blocks(blocks)), as_bytes(data))), \
            "the moved rows are not what the blocks hold"
        full = n // 4
        assert all(bm.blocks[b].hash is not None for b in blocks[:full]), \
            "the full blocks must enter this side's prefix cache (cache_full_blocks)"
        receiver.reset()


def test_land_with_no_room_allocates_nothing(tiny):
    receiver = engine(tiny, num_blocks=4)
    bm = receiver.block_manager
    hog = waiting_seq(receiver, list(range(10, 21)))
    bm.append_slots(hog, 11)                              # 3 of the 4 blocks
    data = receiver.runner.pool.read_blocks([0, 1])
    seq = waiting_seq(receiver, list(range(30, 39)))
    assert land(bm, receiver.runner.pool, seq, 8, data) is None, \
        "8 tokens need 2 blocks and 1 is free: land returns None"
    assert not seq.block_table and bm.num_free_blocks == 1 and seq.num_computed_tokens == 0, \
        "a hand-off that does not fit must leave the pool and the sequence as they were"
    receiver.reset()


def test_disagg_engine_gives_the_paged_engine_s_tokens(tiny):
    from minillm.engines.r11_disagg.engine import DisaggEngine

    prefix = [(7 * i) % 400 + 3 for i in range(14)]
    prompts = [prefix + [i + 3] * (i % 5 + 1) for i in range(6)] + [[5, 9, 3, 11, 40, 2, 8]]
    params = [SamplingParams(max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, top_k=30, seed=3)]
    for opts in ({"kv_cache_dtype": "int8"}, {"enable_prefix_caching": True}):
        opts = dict(block_size=4, num_blocks=64, attention_backend="torch") | opts
        paged = PagedEngine(tiny, **opts)
        want = paged.run([Request(p, params[i % 2], request_id=str(i))
                          for i, p in enumerate(prompts)])
        disagg = DisaggEngine(tiny, **opts)
        try:
            got = disagg.run([Request(p, params[i % 2], request_id=str(i))
                              for i, p in enumerate(prompts)])
            moved = sum(t.landed for t in disagg.transfers.values())
            free, total = disagg.prefill_pool
        finally:
            disagg.close()
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs], \
            f"{opts}: the disagg engine's tokens differ from the paged engine's"
        assert moved == len(prompts), f"{moved} of {len(prompts)} hand-offs landed"
        assert disagg.block_manager.num_free_blocks == disagg.block_manager.num_blocks and \
            free == total, "both pools must be full after the run"
