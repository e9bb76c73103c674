"""Rung 6, speculative decoding's rules: the acceptance rules (greedy; rejection sampling, whose
tokens must follow the target's distribution: chi-square tests, on a 5-token vocabulary and on the
engine), a fixed seed's independence from the batch, and the block books under random propose /
accept / truncate / fork / free (hypothesis, with a simulated KV store)."""
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
from minillm.engines.r6_speculative.rejection import accept_greedy, accept_sampled
from minillm.lab.checks import check_block_invariants
from minillm.request import Request
from test_speculative import assert_pool_full, run


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


@pytest.mark.parametrize("q_kind", ["draft", "point"])
def test_rejection_sampling_gives_the_target_distribution(q_kind):
    """Two positions over a 5-token vocabulary, 4,000 seeds: the first token follows p(.) and the
    second p(.|first), whatever the proposer's q; a deliberately wrong rule (always accept) fails."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, -0.5],
                           [1.0, 0.0, 0.0, 2.0, 0.3]])
    q = torch.softmax(torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 1.0]]), -1)
    p = SamplingParams(temperature=1.0)
    first, firsts_wrong = [0] * 5, [0] * 5
    for seed in range(4000):
        p = dataclasses.replace(p, seed=seed)
        rng = random.Random(seed)
        if q_kind == "draft":
            guesses = [rng.choices(range(5), weights=q[j].tolist())[0] for j in range(2)]
            kept = accept_sampled(guesses, q, logits, p, 0)
        else:
            guesses = [1, 3]
            kept = accept_sampled(guesses, None, logits, p, 0)
        first[kept[0]] += 1
        firsts_wrong[guesses[0]] += 1
    expected = (torch.softmax(logits[0], -1) * 4000).tolist()
    assert chi2_pvalue(first, [round(e) for e in expected]) > 1e-3, (first, expected)
    assert chi2_pvalue(firsts_wrong, [round(e) for e in expected]) < 1e-6, \
        "the test must be able to tell a wrong distribution"


class ArgmaxPointProposer(DraftModelProposer):
    """The target's own argmax as a *certain* guess (q a point mass): exercises the n-gram
    proposer's branch of rejection sampling with guesses that are often, not always, kept."""

    @staticmethod
    def _draw(logits, p, index):
        return int(logits.argmax()), None

    def proposal_probs(self, seq):
        return None


@pytest.mark.parametrize("proposer", ["draft", pytest.param("point", marks=pytest.mark.slow)])
def test_sampled_outputs_follow_the_target_distribution(tiny, proposer):
    """300 seeds of one prompt, top-k 3, four tokens: the distribution of tokens 2-4 with
    speculation equals the plain engine's (chi-square, contingency table per position)."""
    prompt = random_prompts(1, seed=12, lo=6, hi=6)[0]
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
              for s in range(300)]
    _, base = run(LLM(tiny, engine="paged", max_num_seqs=128), [prompt] * 300, params)
    spec = LLM(tiny, engine="paged+draft", draft_layers=1, num_speculative_tokens=3,
               max_num_seqs=128)
    if proposer == "point":
        spec.engine.proposer = ArgmaxPointProposer(spec.engine.runner, 2, spec.engine.block_manager.num_blocks)
    _, res = run(spec, [prompt] * 300, [SamplingParams(**{**vars(p), "seed": p.seed + 10_000})
                                        for p in params])
    stats = res.metrics.extra["speculative"]
    assert 0 < stats["num_accepted"] < stats["num_proposed"], stats
    for pos in (1, 2, 3):
        a = [o.token_ids[pos] for o in base.outputs]
        b = [o.token_ids[pos] for o in res.outputs]
        vocab = sorted(set(a) | set(b))
        pv = chi2_pvalue([a.count(t) for t in vocab], [b.count(t) for t in vocab])
        assert pv > 1e-3, f"position {pos}: p = {pv}"
    assert_pool_full(spec.engine)


@pytest.mark.parametrize("engine", ["paged+draft", "paged+ngram"])
def test_fixed_seed_does_not_depend_on_the_batch(tiny, engine):
    prompt = random_prompts(1, seed=8, lo=60, hi=60)[0] * 2   # the n-gram proposer finds matches
    p = SamplingParams(max_tokens=16, temperature=0.9, seed=123, ignore_eos=True)
    opts = {"draft_layers": 1} if engine == "paged+draft" else {"prompt_lookup_min": 1}
    alone = LLM(tiny, engine=engine, **opts).generate([prompt], p)[0]
    others = random_prompts(7, seed=3, lo=2, hi=25)
    mixed = LLM(tiny, engine=engine, **opts).generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(max_tokens=20, temperature=1.0, seed=k) for k in range(3)] + [p]
        + [SamplingParams(max_tokens=12) for _ in range(4)])[3]
    assert alone.token_ids == mixed.token_ids
    assert alone.spec.num_proposed > 0


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
