"""Exercise 11 — the KV hand-off of prefill/decode disaggregation, in
``minillm/engines/r11_disagg/transfer.py``: ``filled_blocks`` (which blocks move),
``Handoff.nbytes`` and ``recv_blocks`` (how many bytes arrive and how the receiver reads them back
as tensors), ``install_blocks`` (what the receiver allocates and writes).

Graded on values your functions return in your process (``probe_*``, the ``student`` fixture),
judged here: the blocks against the definition (the first ceil(n / block_size)), the bytes
against the package's pools' tensors (fp32, int8 with its scales, bf16, fp8), a round trip
through an in-memory link that holds ``recv_blocks`` to exactly the bytes each message carries,
and ``install_blocks`` on a real block manager and pool (blocks, computed tokens, the rows written, the
prefix cache, and nothing allocated when there is no room — also when the pool is short by the
partly filled block only). Then end to end: the disagg engine, started in your process (both
workers load your file), must give the paged engine's tokens, computed here, and leave both pools
full, with an int8 cache and with prefix caching on.
"""
from __future__ import annotations

import random

import pytest
import torch

from minillm import SamplingParams
from minillm.core.engine import PagedEngine
from minillm.engines.r11_disagg.transfer import (Handoff, filled_blocks, install_blocks, pool_layout,
                                                 recv_blocks)
from minillm.lab.reference import tiny_model
from minillm.request import Request

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
FORMATS = ("auto", "int8", "bfloat16", "fp8")


def filled_cases() -> list:
    """Every block size 1-8, table length 1-12 and token count that fits (2,808 cases; the
    tables' block ids drawn once, seeded)."""
    rng = random.Random(40)
    return [(bs, rng.sample(range(1000), length), n) for bs in range(1, 9)
            for length in range(1, 13) for n in range(1, length * bs + 1)]


def probe_filled_blocks(cases: list) -> list:
    return [[int(b) for b in filled_blocks(list(table), n, bs)] for bs, table, n in cases]


def test_filled_blocks_are_those_that_hold_the_tokens(student):
    cases = filled_cases()
    for (bs, table, n), got in zip(cases, student.run(probe_filled_blocks, cases), strict=True):
        want = table[:-(-n // bs)]             # the last one may be partly filled
        assert got == want, (f"{n} tokens in blocks of {bs}, table {table}: the "
                             f"blocks holding them are {want}, got {got}")


def engine(tiny, fmt="auto", **options):
    opts = dict(block_size=4, num_blocks=16, attention_backend="torch") | options
    return PagedEngine(tiny, kv_cache_dtype=fmt, **opts)


def probe_nbytes(layout: list, counts: list) -> list:
    return [int(Handoff("r", n * 4, n, ()).nbytes(layout)) for n in counts]


@pytest.mark.parametrize("fmt", FORMATS)
def test_nbytes_counts_every_tensor_of_the_pool(tiny, student, fmt):
    pool = engine(tiny, fmt).runner.pool
    layout = pool_layout(pool.tensors())
    counts = (1, 3, 16)
    for n, got in zip(counts, student.run(probe_nbytes, layout, list(counts)), strict=True):
        rows = pool.read_blocks(list(range(n)))          # what a transfer of n blocks sends
        want = sum(t.numel() * t.element_size() for t in rows)
        assert got == want, (f"kv_cache_dtype={fmt}, {n} blocks: {want} bytes move (every "
                             f"tensor of the pool, K and V of each layer, scales too), got {got}")


class Link:
    """An in-memory link: ``isend`` queues a message, ``recv`` takes the next one, which must
    be exactly what it asks for (as gloo's would: a receive of the wrong size is an error)."""

    def __init__(self, messages: list):
        self.messages = list(messages)

    def isend(self, tensor, dst, tag=0):
        self.messages.append(tensor.clone())

    def recv(self, shape, dtype, src, tag=0, what="recv", microbatch=-1, timeout_s=None):
        if not self.messages:
            raise ValueError("recv_blocks asked for more messages than send_blocks sent")
        msg = self.messages.pop(0)
        if dtype != torch.uint8 or tuple(shape) != tuple(msg.shape):
            raise ValueError(
                f"recv_blocks asked for a {tuple(shape)} {dtype} tensor; the message on the wire "
                f"is {tuple(msg.shape)} uint8 bytes (each pool tensor's bytes, flat)")
        return msg


def probe_recv(messages: list, num_blocks: int, layout: list) -> tuple:
    link = Link(messages)
    got = recv_blocks(link, 1, num_blocks, layout)
    return [t.contiguous() for t in got], len(link.messages)


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool.tensors():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


def as_bytes(tensors):
    return [t.contiguous().view(torch.uint8) for t in tensors]


@pytest.mark.parametrize("fmt", FORMATS)
def test_recv_blocks_reads_back_exactly_what_was_sent(tiny, student, fmt):
    pool = engine(tiny, fmt).runner.pool
    fill(pool, seed=11)
    sent = pool.read_blocks([5, 2, 9])
    wire = [t.contiguous().view(torch.uint8).reshape(-1) for t in sent]    # send_blocks' messages
    got, left = student.run(probe_recv, wire, 3, pool_layout(pool.tensors()))
    assert left == 0, "recv_blocks left messages on the wire"
    assert len(got) == len(sent), f"{len(sent)} tensors were sent, {len(got)} read"
    for a, b in zip(got, sent):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"a tensor read back as {tuple(a.shape)} {a.dtype}; it was sent as "
            f"{tuple(b.shape)} {b.dtype}")
    assert all(torch.equal(x, y) for x, y in zip(as_bytes(got), as_bytes(sent))), \
        f"kv_cache_dtype={fmt}: the bytes read back differ from those sent"


def waiting_seq(eng, prompt):
    return eng.scheduler.add(Request(prompt, SamplingParams(max_tokens=3))).seqs[0]


def probe_land(fmt: str, cases: list) -> list:
    """``install_blocks`` on a receiving engine's block manager and pool, for each (tokens, rows): what
    it returned, the sequence's table and computed tokens, the blocks the pool lost, the rows
    the blocks hold afterwards, and which blocks have a prefix-cache hash."""
    receiver = engine(tiny_model(), fmt, enable_prefix_caching=True)
    bm, pool, out = receiver.block_manager, receiver.runner.pool, []
    for n, data in cases:
        seq = waiting_seq(receiver, list(range(10 * n, 11 * n + 1)))   # (nothing cached yet)
        free = bm.num_free_blocks
        blocks = install_blocks(bm, pool, seq, n, data)
        blocks = None if blocks is None else [int(b) for b in blocks]
        out.append({"blocks": blocks, "table": [int(b) for b in seq.block_table],
                    "lost": free - bm.num_free_blocks, "computed": int(seq.num_computed_tokens),
                    "rows": [t.contiguous() for t in pool.read_blocks(blocks)] if blocks else [],
                    "hashed": [bm.blocks[b].hash is not None for b in blocks or []]})
        receiver.reset()
    return out


@pytest.mark.parametrize("fmt", ("auto", "int8"))
def test_land_allocates_writes_and_caches(tiny, student, fmt):
    sender = engine(tiny, fmt)
    fill(sender.runner.pool, seed=12)
    counts = (9, 8, 1)                  # a partly filled last block, full blocks, one token
    cases = [(n, sender.runner.pool.read_blocks(list(range(-(-n // 4))))) for n in counts]
    for (n, data), got in zip(cases, student.run(probe_land, fmt, cases), strict=True):
        blocks = got["blocks"]
        assert blocks is not None and blocks == got["table"], \
            "install_blocks returns the blocks it gave the sequence (its block table)"
        assert len(blocks) == len(data[0]) and got["lost"] == len(blocks), \
            f"{n} tokens need {len(data[0])} blocks; the pool lost {got['lost']}"
        assert got["computed"] == n, \
            f"the {n} moved tokens count as computed, got num_computed_tokens={got['computed']}"
        assert all(torch.equal(x, y) for x, y in zip(as_bytes(got["rows"]), as_bytes(data))), \
            "the moved rows are not what the blocks hold"
        assert all(got["hashed"][:n // 4]), \
            "the full blocks must enter this side's prefix cache (cache_full_blocks)"


def probe_no_room(cases: list) -> list:
    """A pool of 4 blocks of 4 slots, ``hog`` tokens held by another sequence; then ``install_blocks`` of
    ``n`` tokens: what it returned, the new sequence's table and computed tokens, blocks free."""
    out = []
    for hog_tokens, n in cases:
        receiver = engine(tiny_model(), num_blocks=4)
        bm = receiver.block_manager
        hog = waiting_seq(receiver, list(range(10, 10 + hog_tokens)))
        bm.append_slots(hog, hog_tokens)
        data = receiver.runner.pool.read_blocks(list(range(-(-n // 4))))
        seq = waiting_seq(receiver, list(range(30, 31 + n)))
        try:
            got = install_blocks(bm, receiver.runner.pool, seq, n, data)
            answer = None if got is None else [int(b) for b in got]
        except NotImplementedError:
            raise                     # a stub: the test fails with its message
        except Exception as e:        # noqa: BLE001 - judged by the grader: it must not raise
            answer = f"raised {type(e).__name__}: {e}"
        out.append((answer, [int(b) for b in seq.block_table], int(seq.num_computed_tokens),
                    int(bm.num_free_blocks)))
        receiver.reset()
    return out


def test_land_with_no_room_allocates_nothing(student):
    """8 tokens (2 blocks) with 1 free; 9 tokens (3 blocks, the last partly filled) with 2 free:
    a room check that counts full blocks only (n // block_size) lets the second through."""
    cases = [(11, 8), (8, 9)]
    for (hog, n), (answer, table, computed, free) in zip(cases, student.run(probe_no_room, cases),
                                                         strict=True):
        need, have = -(-n // 4), 4 - -(-hog // 4)
        assert answer is None, (f"{n} tokens need {need} blocks and {have} are free: install_blocks "
                                f"returns None (got {answer})")
        assert not table and free == have and computed == 0, \
            "a hand-off that does not fit must leave the pool and the sequence as they were"


PREFIX = [(7 * i) % 400 + 3 for i in range(14)]
PROMPTS = [PREFIX + [i + 3] * (i % 5 + 1) for i in range(6)] + [[5, 9, 3, 11, 40, 2, 8]]
PARAMS = [dict(max_tokens=8, ignore_eos=True), dict(max_tokens=6, temperature=0.9, top_k=30,
                                                      seed=3)]
OPTIONS = ({"kv_cache_dtype": "int8"}, {"enable_prefix_caching": True})


def requests() -> list:
    return [Request(p, SamplingParams(**PARAMS[i % 2]), request_id=str(i))
            for i, p in enumerate(PROMPTS)]


def probe_disagg(opts: dict) -> dict:
    """The paged engine and the disagg engine, started here (the student's process: both
    workers load the student's file)."""
    from minillm.engines.r11_disagg.engine import DisaggEngine
    paged = PagedEngine(tiny_model(), **opts).run(requests())
    disagg = DisaggEngine(tiny_model(), **opts)
    try:
        got = disagg.run(requests())
        moved = sum(t.landed for t in disagg.transfers.values())
        free, total = disagg.prefill_pool
        full = disagg.block_manager.num_free_blocks == disagg.block_manager.num_blocks
    finally:
        disagg.close()
    return {"tokens": [[int(t) for t in o.token_ids] for o in got.outputs], "moved": int(moved),
            "paged": [[int(t) for t in o.token_ids] for o in paged.outputs],
            "full": bool(full and free == total)}


@pytest.mark.parametrize("opts", OPTIONS, ids=["int8", "prefix"])
def test_disagg_engine_gives_the_paged_engine_s_tokens(tiny, student, opts):
    from minillm.lab.reference import package_reference
    opts = dict(block_size=4, num_blocks=64, attention_backend="torch") | opts
    got = student.run(probe_disagg, opts)
    assert got["tokens"] == got["paged"], \
        f"{opts}: the disagg engine's tokens differ from the paged engine's"
    want = package_reference(lambda: [[int(t) for t in o.token_ids]
                                      for o in PagedEngine(tiny, **opts).run(requests()).outputs])
    assert want is None or got["tokens"] == want, \
        f"{opts}: the disagg engine's tokens differ from the package's paged engine's"
    assert got["moved"] == len(PROMPTS), f"{got['moved']} of {len(PROMPTS)} hand-offs landed"
    assert got["full"], "both pools must be full after the run"
