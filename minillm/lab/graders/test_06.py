"""Exercise 06 — speculative decoding's acceptance rules: ``accept_greedy``, ``accept_seeded`` and
``accept_sampled`` in ``rejection.py``.

Greedy: the kept tokens are the guesses up to the first wrong one, then the target's own token;
the speculative engine built on the student's rule must produce the plain engine's tokens (Hugging
Face's) with guesses that are right, wrong and half right. Seeded sampling: every kept token is the
one plain decoding draws at its output index, so the engine on the student's rule must reproduce
the plain engine's seeded samples token for token. Unseeded sampling (rejection): whatever the
proposer's distribution q, the first token kept must follow the target's p (a chi-square test over
3,000 seeds).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from minillm import LLM, SamplingParams
from minillm.engines.r6_speculative.engine import SpeculativeEngine
from minillm.engines.r6_speculative.rejection import accept_greedy, accept_sampled, accept_seeded
from minillm.lab.reference import assert_greedy_match, hf_greedy, random_prompts
from minillm.request import Request
from minillm.sampling import draw_uniform, sample_one


def test_greedy_keeps_the_right_guesses_and_adds_the_targets_token():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7], \
        "all guesses right: keep them all, plus the target's token after the last one"
    assert accept_greedy([4, 9, 6], [4, 5, 6, 7]) == [4, 5], \
        "a wrong guess: keep the guesses before it, then the target's token instead of it"
    assert accept_greedy([9], [3, 8]) == [3], "even the first guess wrong: the target's token"
    assert accept_greedy([], [2]) == [2], "no guesses: the target's own token"


class HalfRightProposer:
    """Guesses the reference's next tokens, every third one wrong."""

    def __init__(self, refs):
        self.refs = refs

    def propose(self, seqs, k):
        ks = [k] * len(seqs) if isinstance(k, int) else k
        out = []
        for s, k_s in zip(seqs, ks):
            o = len(s.output_token_ids)
            ref = self.refs[s.request.request_id][o:o + k_s]
            out.append([t if (o + j) % 3 else (t + 1) % 500 for j, t in enumerate(ref)])
        return out

    def proposal_probs(self, seq):
        return None

    def reset(self):
        pass


def run_half_right(tiny, params: SamplingParams) -> None:
    """The paged engine without speculation is the reference; the speculative engine, guessing
    the reference's tokens with every third guess wrong, must not change a single token."""
    prompts = random_prompts(5, seed=17, lo=3, hi=20)

    def requests():
        return [Request(list(p), SamplingParams(**{**vars(params), "seed": None if params.seed is None
                                                   else params.seed + i}), request_id=f"r{i}")
                for i, p in enumerate(prompts)]
    plain = LLM(tiny, engine="paged", block_size=4, attention_backend="torch").run(requests())
    refs = {o.request_id: o.token_ids for o in plain.outputs}
    if params.greedy:      # the plain engine itself equals Hugging Face ``generate``
        assert_greedy_match(refs["r0"], hf_greedy(tiny, prompts[0], 16), label="r0 (plain)")
    engine = SpeculativeEngine(tiny, proposer=HalfRightProposer(refs), speculative="ngram",
                               num_speculative_tokens=3, block_size=4,
                               attention_backend="torch")
    res = engine.run(requests())
    for out in res.outputs:
        assert out.token_ids == refs[out.request_id], (
            f"{out.request_id}: with speculation {out.token_ids}, without {refs[out.request_id]}")
    stats = res.metrics.extra["speculative"]
    assert 0 < stats["num_accepted"] < stats["num_proposed"]


def test_speculative_engine_on_this_rule_equals_plain_decoding(tiny):
    run_half_right(tiny, SamplingParams(max_tokens=16, ignore_eos=True))


def test_seeded_rule_keeps_plain_decodings_draw():
    """The seed promise: output token i of a seeded request is the one plain decoding draws,
    ``sample_one(logits, ..., draw_uniform(seed, i))``, whether or not position i was guessed."""
    torch.manual_seed(5)
    for seed in range(60):
        logits = torch.randn(4, 6) * 2
        params = SamplingParams(temperature=1.3, seed=seed)
        plain = [sample_one(logits[j], 1.3, 0, 1.0, draw_uniform(seed, 11 + j)) for j in range(4)]
        for wrong in (0, 1, 2, None):
            guesses = [(t + 1) % 6 if j == wrong else t for j, t in enumerate(plain[:3])]
            want = plain if wrong is None else plain[:wrong + 1]
            got = accept_seeded(guesses, logits, params, 11)
            assert got == want, (
                f"seed {seed}, output indices 11-14, guesses {guesses}: kept {got}, but plain "
                f"decoding draws {plain} there (keep guesses while they equal its draw, then add "
                f"its own draw; the uniform of output index i is draw_uniform(seed, i))")


def test_speculative_engine_on_the_seeded_rule_equals_plain_sampling(tiny):
    run_half_right(tiny, SamplingParams(max_tokens=16, temperature=1.0, seed=40, ignore_eos=True))


def chi2_pvalue(observed: list[int], expected: list[float]) -> float:
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    return float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_tokens_follow_the_target_distribution():
    logits = torch.tensor([[1.5, 1.0, 0.2, 0.0], [0.0, 2.0, 0.5, 0.1], [0.3, 0.3, 1.0, 0.0]])
    p_first = torch.softmax(logits[0], -1)
    q = torch.softmax(torch.tensor([[0.0, 2.5, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]), -1)
    for draft in (True, False):        # a draft model's q, and a certain guess (n-gram)
        counts = [0] * 4
        for seed in range(3000):
            params = SamplingParams(temperature=1.0, seed=seed)
            rng = random.Random(seed)
            guesses = [rng.choices(range(4), q[j].tolist())[0] for j in range(2)] if draft else [1, 2]
            kept = accept_sampled(guesses, q if draft else None, logits, params, 0)
            assert 1 <= len(kept) <= 3
            counts[kept[0]] += 1
        pv = chi2_pvalue(counts, (p_first * 3000).tolist())
        assert pv > 1e-4, (f"the first kept token does not follow the target's distribution "
                           f"(p-value {pv:.1e}): counts {counts}, expected "
                           f"{[round(x) for x in (p_first * 3000).tolist()]}")
