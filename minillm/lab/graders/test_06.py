"""Exercise 06 — speculative decoding's acceptance rules: ``accept_greedy``, ``accept_seeded`` and
``accept_sampled`` in ``rejection.py``.

Greedy: the kept tokens are the guesses up to the first wrong one, then the target's own token;
the speculative engine built on the student's rule must produce the plain engine's tokens (Hugging
Face's) with guesses that are right, wrong and half right. Seeded sampling: every kept token is the
one plain decoding draws at its output index, so the engine on the student's rule must reproduce
the plain engine's seeded samples token for token. Unseeded sampling (rejection): whatever the
proposer's distribution q, the first token kept must follow the target's p (a chi-square test over
3,000 seeds).

Every call of your functions happens in your process (the ``student`` fixture); the values come
back here and are judged against the definition and the plain engine run in the grading process.
"""
from __future__ import annotations

import random

import torch

from minillm import LLM, SamplingParams
from minillm.engines.r6_speculative.engine import SpeculativeEngine
from minillm.engines.r6_speculative.rejection import accept_greedy, accept_sampled, accept_seeded
from minillm.lab.reference import (assert_greedy_match, baseline, hf_greedy, random_prompts,
                                   tiny_model)
from minillm.request import Request
from minillm.sampling import draw_uniform, sample_one

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)


def probe_greedy(cases: list) -> list:
    return [[int(t) for t in accept_greedy(list(g), list(t))] for g, t in cases]


def test_greedy_keeps_the_right_guesses_and_adds_the_targets_token(student):
    cases = [(([4, 5, 6], [4, 5, 6, 7]), [4, 5, 6, 7],
              "all guesses right: keep them all, plus the target's token after the last one"),
             (([4, 9, 6], [4, 5, 6, 7]), [4, 5],
              "a wrong guess: keep the guesses before it, then the target's token instead of it"),
             (([9], [3, 8]), [3], "even the first guess wrong: the target's token"),
             (([], [2]), [2], "no guesses: the target's own token")]
    got = student.run(probe_greedy, [c[0] for c in cases])
    for (args, want, why), g in zip(cases, got):
        assert g == want, f"accept_greedy{args} returned {g}: {why}"


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


def half_right_requests(params: dict) -> list[Request]:
    prompts = random_prompts(5, seed=17, lo=3, hi=20)
    seed = params.get("seed")
    return [Request(list(p), SamplingParams(**{**params, "seed": None if seed is None
                                               else seed + i}), request_id=f"r{i}")
            for i, p in enumerate(prompts)]


def probe_speculative_engine(params: dict, refs: dict) -> tuple[dict, int, int]:
    """The speculative engine on the student's rule, guessing ``refs`` with every third guess
    wrong: its tokens per request, and (accepted, proposed) guesses."""
    engine = SpeculativeEngine(tiny_model(), proposer=HalfRightProposer(refs), speculative="ngram",
                               num_speculative_tokens=3, block_size=4, attention_backend="torch")
    res = engine.run(half_right_requests(params))
    stats = res.metrics.extra["speculative"]
    return ({o.request_id: [int(t) for t in o.token_ids] for o in res.outputs},
            int(stats["num_accepted"]), int(stats["num_proposed"]))


def probe_plain(params: dict) -> dict:
    """The paged engine without speculation: each request's tokens."""
    plain = LLM(tiny_model(), engine="paged", block_size=4, attention_backend="torch").run(
        half_right_requests(params))
    return {o.request_id: [int(t) for t in o.token_ids] for o in plain.outputs}


def run_half_right(student, tiny, params: dict) -> None:
    """The paged engine without speculation, run here, is the reference; the speculative engine
    on the student's rule, guessing the reference's tokens with every third guess wrong, must not
    change a single token."""
    refs = baseline(student, probe_plain, params)
    if params.get("temperature", 0) == 0:   # the plain engine itself equals HF ``generate``
        prompt = half_right_requests(params)[0].prompt_token_ids
        assert_greedy_match(refs["r0"], hf_greedy(tiny, list(prompt), 16), label="r0 (plain)")
    got, accepted, proposed = student.run(probe_speculative_engine, params, refs)
    for rid, want in refs.items():
        assert got.get(rid) == want, f"{rid}: with speculation {got.get(rid)}, without {want}"
    assert 0 < accepted < proposed, f"{accepted} of {proposed} guesses kept: every third is wrong"


def test_speculative_engine_on_this_rule_equals_plain_decoding(student, tiny):
    run_half_right(student, tiny, dict(max_tokens=16, ignore_eos=True))


def probe_seeded(cases: list) -> list:
    return [[int(t) for t in accept_seeded(list(g), logits, SamplingParams(temperature=1.3,
                                                                           seed=seed), 11)]
            for g, logits, seed in cases]


def test_seeded_rule_keeps_plain_decodings_draw(student):
    """The seed promise: output token i of a seeded request is the one plain decoding draws,
    ``sample_one(logits, ..., draw_uniform(seed, i))``, whether or not position i was guessed."""
    torch.manual_seed(5)
    cases, wants = [], []
    for seed in range(60):
        logits = torch.randn(4, 6) * 2
        plain = [sample_one(logits[j], 1.3, 0, 1.0, draw_uniform(seed, 11 + j)) for j in range(4)]
        for wrong in (0, 1, 2, None):
            guesses = [(t + 1) % 6 if j == wrong else t for j, t in enumerate(plain[:3])]
            cases.append((guesses, logits, seed))
            wants.append((plain, plain if wrong is None else plain[:wrong + 1]))
    for (guesses, _, seed), (plain, want), got in zip(cases, wants,
                                                      student.run(probe_seeded, cases)):
        if got != want:
            raise AssertionError(
                f"seed {seed}, output indices 11-14, guesses {guesses}: kept {got}, but plain "
                f"decoding draws {plain} there (keep guesses while they equal its draw, then add "
                f"its own draw; the uniform of output index i is draw_uniform(seed, i))")


def test_speculative_engine_on_the_seeded_rule_equals_plain_sampling(student, tiny):
    run_half_right(student, tiny, dict(max_tokens=16, temperature=1.0, seed=40, ignore_eos=True))


def chi2_pvalue(observed: list[int], expected: list[float]) -> float:
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    return float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


LOGITS = [[1.5, 1.0, 0.2, 0.0], [0.0, 2.0, 0.5, 0.1], [0.3, 0.3, 1.0, 0.0]]
Q_LOGITS = [[0.0, 2.5, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]


def probe_first_kept(draft: bool) -> list:
    """What ``accept_sampled`` keeps over 3,000 seeds: [how many it kept, its first token]."""
    logits, q = torch.tensor(LOGITS), torch.softmax(torch.tensor(Q_LOGITS), -1)
    out = []
    for seed in range(3000):
        params = SamplingParams(temperature=1.0, seed=seed)
        rng = random.Random(seed)
        guesses = [rng.choices(range(4), q[j].tolist())[0] for j in range(2)] if draft else [1, 2]
        kept = accept_sampled(guesses, q if draft else None, logits, params, 0)
        out.append([len(kept), int(kept[0]) if len(kept) else -1])
    return out


def test_sampled_tokens_follow_the_target_distribution(student):
    p_first = torch.softmax(torch.tensor(LOGITS)[0], -1)
    for draft in (True, False):        # a draft model's q, and a certain guess (n-gram)
        counts = [0] * 4
        for n, first in student.run(probe_first_kept, draft):
            assert 1 <= n <= 3 and 0 <= first < 4, \
                f"accept_sampled kept {n} tokens (first {first}): 1 to 3 of the 4-token vocabulary"
            counts[first] += 1
        pv = chi2_pvalue(counts, (p_first * 3000).tolist())
        assert pv > 1e-4, (f"the first kept token does not follow the target's distribution "
                           f"(p-value {pv:.1e}): counts {counts}, expected "
                           f"{[round(x) for x in (p_first * 3000).tolist()]}")
