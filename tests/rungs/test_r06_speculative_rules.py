"""Rung 6, speculative decoding's rules: the acceptance rules (greedy; seeded, whose tokens must be
plain decoding's; rejection sampling, whose tokens must follow the target's distribution:
chi-square tests, on a 5-token vocabulary and on the engine), the seed promise (a seeded request's
tokens are plain paged's, alone or in a batch that preempts it), and the block books under random
propose / accept / truncate / fork / free (hypothesis, with a simulated KV store)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_prompts
from minillm import LLM, SamplingParams
from minillm.core.block_manager import BlockManager
from minillm.core.sequence import Sequence
from minillm.engines.r6_speculative.proposers import DraftModelProposer
from minillm.engines.r6_speculative.rejection import accept_greedy, accept_sampled, accept_seeded
from minillm.lab.checks import check_block_invariants
from minillm.request import Request
from minillm.sampling import draw_uniform, sample_one
from test_r06_speculative import assert_pool_full, run


# --- acceptance rules ------------------------------------------------------------------------------
def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 9, 7], [5, 6, 7, 8]) == [5, 6]
    assert accept_greedy([1], [2, 3]) == [2]
    assert accept_greedy([], [4]) == [4]


def chi2_pvalue(counts_a: list[int], counts_b: list[float]) -> float:
    """Chi-square test of ``counts_a`` against expected counts (or a second sample's counts when
    both are observed, as a 2 x m contingency table): the p-value via the incomplete gamma."""
    a = torch.tensor(counts_a, dtype=torch.float64)
    b = torch.tensor(counts_b, dtype=torch.float64)
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = float((((a - ea) ** 2) / ea + ((b - eb) ** 2) / eb).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_accept_seeded_is_plain_decodings_draw():
    """Whatever the guesses, every kept token is the one plain decoding draws at its output index
    (``draw_uniform(seed, index)``): guesses are kept while they equal it, then its own draw."""
    torch.manual_seed(0)
    for seed in range(200):
        logits = torch.randn(4, 7) * 2
        p = SamplingParams(temperature=1.5, top_k=5 if seed % 2 else 0, seed=seed)
        plain = [sample_one(logits[j], 1.5, p.top_k, 1.0, draw_uniform(seed, 9 + j))
                 for j in range(4)]
        assert accept_seeded(plain[:3], logits, p, 9) == plain, "all guesses right: k + 1 tokens"
        assert accept_seeded([], logits[:1], p, 9) == plain[:1]
        wrong = seed % 3
        guesses = plain[:3]
        guesses[wrong] = (guesses[wrong] + 1) % 7
        assert accept_seeded(guesses, logits, p, 9) == plain[:wrong + 1]


def coupled_guesses(q: torch.Tensor, seed: int) -> list[int]:
    """A draft's guesses drawn from ``q`` as ``DraftModelProposer._draw`` does for a seeded request:
    plain decoding's inverse CDF with the uniform the target uses at the same index."""
    return [sample_one(q[j].log(), 1.0, 0, 1.0, draw_uniform(seed, j)) for j in range(len(q))]


@pytest.mark.parametrize("rule,q_kind", [("sampled", "draft"), ("sampled", "point"),
                                         ("seeded", "draft"), ("seeded", "point")])
def test_acceptance_gives_the_target_distribution(rule, q_kind):
    """Two positions over a 5-token vocabulary, 4,000 seeds: the first token follows p(.) and the
    second p(.|first), whatever the proposer's q (a distribution, or a point mass as the n-gram
    proposer's); a deliberately wrong rule (always accept) fails."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, -0.5],
                           [1.0, 0.0, 0.0, 2.0, 0.3]])
    q = torch.softmax(torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 1.0]]), -1)
    first, firsts_wrong, second = [0] * 5, [0] * 5, [0] * 5
    for seed in range(4000):
        p = SamplingParams(temperature=1.0, seed=seed)
        if q_kind == "point":
            guesses, probs = [1, 3], None
        elif rule == "seeded":
            guesses, probs = coupled_guesses(q, seed), q
        else:
            rng = random.Random(seed)
            guesses, probs = [rng.choices(range(5), weights=q[j].tolist())[0] for j in range(2)], q
        kept = accept_seeded(guesses, logits, p, 0) if rule == "seeded" else \
            accept_sampled(guesses, probs, logits, p, 0)
        first[kept[0]] += 1
        firsts_wrong[guesses[0]] += 1
        if len(kept) > 1:          # the first guess kept: the second token was checked after it
            second[kept[1]] += 1
    expected = (torch.softmax(logits[0], -1) * 4000).tolist()
    assert chi2_pvalue(first, [round(e) for e in expected]) > 1e-3, (first, expected)
    assert chi2_pvalue(firsts_wrong, [round(e) for e in expected]) < 1e-6, \
        "the test must be able to tell a wrong distribution"
    # the second token after a kept first guess follows the target's row for that context
    n = sum(second)
    assert n > 100, second
    assert chi2_pvalue(second, [float(e) for e in torch.softmax(logits[1], -1) * n]) > 1e-3, second


class ArgmaxPointProposer(DraftModelProposer):
    """The target's own argmax as a *certain* guess (q a point mass): exercises the n-gram
    proposer's branch of rejection sampling with guesses that are often, not always, kept."""

    @staticmethod
    def _draw(logits, p, index, sample_id=0):
        return int(logits.argmax()), None

    def proposal_probs(self, seq):
        return None


@pytest.mark.parametrize("proposer,seeded", [
    ("draft", True), ("draft", False), pytest.param("point", True, marks=pytest.mark.slow),
    pytest.param("point", False, marks=pytest.mark.slow)])
def test_sampled_outputs_follow_the_target_distribution(tiny, proposer, seeded):
    """300 prompts alike, top-k 3, four tokens. Seeded: every request's tokens are the plain
    engine's for its seed. Unseeded (rejection sampling, the global ``random`` seeded so the test
    repeats): the distribution of tokens 2-4 equals the plain engine's (chi-square, contingency
    table per position)."""
    prompt = random_prompts(1, seed=12, lo=6, hi=6)[0]
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
              for s in range(300)]
    _, base = run(LLM(tiny, engine="paged", max_num_seqs=128), [prompt] * 300, params)
    spec = LLM(tiny, engine="paged+draft", draft_layers=1, num_speculative_tokens=3,
               max_num_seqs=128)
    if proposer == "point":
        spec.engine.proposer = ArgmaxPointProposer(spec.engine.runner, 2, spec.engine.block_manager.num_blocks)
    state = random.getstate()
    try:
        random.seed(2024)
        _, res = run(spec, [prompt] * 300, params if seeded else
                     [SamplingParams(**{**vars(p), "seed": None}) for p in params])
    finally:
        random.setstate(state)
    stats = res.metrics.extra["speculative"]
    assert 0 < stats["num_accepted"] < stats["num_proposed"], stats
    if seeded:
        assert [o.token_ids for o in res.outputs] == [o.token_ids for o in base.outputs]
    for pos in (1, 2, 3):
        a = [o.token_ids[pos] for o in base.outputs]
        b = [o.token_ids[pos] for o in res.outputs]
        vocab = sorted(set(a) | set(b))
        pv = chi2_pvalue([a.count(t) for t in vocab], [b.count(t) for t in vocab])
        assert pv > 1e-3, f"position {pos}: p = {pv}"
    assert_pool_full(spec.engine)


SEED_CASES = {"ngram": ("paged+ngram", {"prompt_lookup_min": 1}),
              "draft": ("paged+draft", {"draft_layers": 1}),
              "full-draft": ("paged+draft", {"draft_layers": 2})}    # q = p: most guesses kept
_plain_seeded: list = []


@pytest.mark.parametrize("case", list(SEED_CASES))
def test_seeded_sample_does_not_depend_on_batch_pool_or_guesses(tiny, case):
    """The seed promise: a seeded request (temperature 2, seed 123) gives the plain paged engine's
    tokens run alone, and run last behind 12 others on a pool of 40 blocks of 4 that preempts it
    (it then recomputes without guesses, and its guesses land elsewhere)."""
    engine, opts = SEED_CASES[case]
    prompt = random_prompts(1, seed=8, lo=24, hi=24)[0] * 2   # the n-gram proposer finds matches
    p = SamplingParams(max_tokens=24, temperature=2.0, seed=123, ignore_eos=True)
    pool = {"num_blocks": 40, "block_size": 4}
    if not _plain_seeded:
        _plain_seeded.append(LLM(tiny, engine="paged", **pool).generate([prompt], p)[0].token_ids)
    plain = _plain_seeded[0]
    alone = LLM(tiny, engine=engine, **pool, **opts).generate([prompt], p)[0]
    assert alone.token_ids == plain, "speculation changed a seeded sample"
    assert alone.spec.num_proposed > 0
    llm = LLM(tiny, engine=engine, **pool, **opts)
    others = random_prompts(12, seed=3, lo=8, hi=30)
    reqs = llm.make_requests(others + [prompt], [
        SamplingParams(max_tokens=20, temperature=1.0, seed=k, ignore_eos=True) for k in range(6)]
        + [SamplingParams(max_tokens=16, ignore_eos=True) for _ in range(6)] + [p])
    res = llm.run(reqs)
    assert reqs[-1].num_preemptions > 0, "the pool should preempt the seeded request"
    assert res.outputs[-1].token_ids == plain, "the batch or a preemption changed a seeded sample"
    if case == "full-draft":
        assert alone.spec.num_accepted > 0 and res.outputs[-1].spec.num_accepted > 0
    assert_pool_full(llm.engine)


# --- rollback keeps the books ------------------------------------------------------------------------
ops = st.lists(st.tuples(st.sampled_from(["new", "propose", "accept", "truncate", "fork", "free"]),
                         st.integers(0, 10_000), st.integers(0, 12)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 8]),
       prefix=st.booleans())
def test_propose_verify_truncate_fork_free_keep_the_books(ops, num_blocks, block_size, prefix):
    """A simulated KV store (slot -> token written there) checks, after every operation, that each
    sequence's computed slots still hold its own tokens (no shared block was written, rollback
    lost nothing it kept) and that every cached block holds the tokens its hash stands for."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    req = Request([1], SamplingParams())
    kv: dict[int, int] = {}
    seqs: list[Sequence] = []
    guesses: dict[int, int] = {}          # seq_id -> guesses computed but not yet verified

    def compute(seq, n):
        if not bm.can_append(seq, n):
            return False
        for src, dst in bm.append_slots(seq, n):
            for i in range(block_size):
                if src * block_size + i in kv:
                    kv[dst * block_size + i] = kv[src * block_size + i]
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            kv[bm.slot(seq, pos)] = seq.token_ids[pos]
        seq.num_computed_tokens += n
        return True

    for op, pick, n in ops:
        if op == "new":
            seq = Sequence(req, [(pick + i) % 3 for i in range(n + 1)], n + 1)
            bm.allocate_cached_prefix(seq)
            if compute(seq, seq.num_uncomputed):
                bm.cache_full_blocks(seq)
                seqs.append(seq)
            else:
                bm.free(seq)
            continue
        if not seqs:
            continue
        seq = seqs[pick % len(seqs)]
        pending = guesses.get(seq.seq_id, 0)
        if op == "propose" and not pending and n:
            seq.token_ids += [(pick + j) % 3 for j in range(n)]
            if compute(seq, n):
                guesses[seq.seq_id] = n
            else:
                del seq.token_ids[-n:]
        elif op == "accept" and pending:
            keep = seq.num_tokens - pending + pick % (pending + 1)    # accepted prefix
            del seq.token_ids[keep:]
            bm.truncate(seq, keep)
            bm.cache_full_blocks(seq)
            del guesses[seq.seq_id]
        elif op == "truncate" and not pending:
            keep = pick % (seq.num_computed_tokens + 1)
            del seq.token_ids[keep:]
            bm.truncate(seq, keep)
        elif op == "fork" and not pending:
            seqs.append(bm.fork(seq))
        elif op == "free":
            bm.free(seq)
            seqs.remove(seq)
            guesses.pop(seq.seq_id, None)
        check_block_invariants(bm, seqs)
        for s in seqs:
            assert len(s.block_table) == -(-s.num_computed_tokens // block_size) or \
                s.seq_id in guesses or s.num_computed_tokens < len(s.block_table) * block_size
            for pos in range(s.num_computed_tokens):
                assert kv[bm.slot(s, pos)] == s.token_ids[pos], f"seq {s.seq_id} position {pos}"
        for h, bid in bm.cached.items():
            assert tuple(kv.get(bid * block_size + i) for i in range(block_size)) == \
                bm.blocks[bid].key[1], f"cached block {bid} holds other tokens than its hash"
    for s in seqs:
        bm.free(s)
    check_block_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks, "no block leaks"


def test_truncate_rejects_bad_lengths_and_frees_at_once():
    bm = BlockManager(8, 4)
    seq = Sequence(Request([1], SamplingParams()), list(range(10)), 10)
    bm.append_slots(seq, 10)
    seq.num_computed_tokens = 10
    bm.truncate(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6 and seq.num_computed_tokens == 5
    for bad in (-1, 9, 2.0, True, "3"):
        with pytest.raises(ValueError, match="num_tokens must be an int in \\[0, 8\\]"):
            bm.truncate(seq, bad)
