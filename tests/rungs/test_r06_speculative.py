"""Rung 6, speculative decoding on the engine: greedy output equals the plain paged engine token
for token (and Hugging Face's) with preemption, prefix caching and small budgets, beside n > 1 and
beam requests, on tiny-llama and SmolLM2; the soak test with speculation; configuration, CLI,
bench and abort/reset. The acceptance rules and the block books: test_r06_speculative_rules.py."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_greedy_match, drain, hf_greedy, random_prompts
from minillm import LLM, SamplingParams
from minillm.engines.r6_speculative import SpeculativeConfig
from minillm.engines.r6_speculative.proposers import NgramProposer
from minillm.lab.checks import check_block_invariants
from minillm.request import FinishReason, Request


class OracleProposer:
    """Guesses the reference's next tokens, wrong at a pseudo-random third of the positions: every
    pattern of acceptance (none, some, all) happens, deterministically."""

    def __init__(self, refs: dict[str, list[int]], wrong: int = 7):
        self.refs, self.wrong = refs, wrong

    def propose(self, seqs, k):
        ks = [k] * len(seqs) if isinstance(k, int) else k
        out = []
        for s, k_s in zip(seqs, ks):
            o = len(s.output_token_ids)
            ref = self.refs.get(s.request.request_id, [])[o:o + k_s]
            out.append([t if hash((s.request.request_id, o + j)) % 3 else (t + self.wrong) % 500
                        for j, t in enumerate(ref)])
        return out

    def proposal_probs(self, seq):
        return None

    def reset(self):
        pass


def assert_pool_full(engine):
    bm = engine.block_manager
    check_block_invariants(bm, engine.scheduler.live_seqs())
    assert bm.num_free_blocks == bm.num_blocks, "every block back in the pool"


@pytest.fixture(scope="module")
def case(tiny):
    prompts = random_prompts(8, seed=5, lo=2, hi=30)
    prompts[3] = prompts[0][:9] + prompts[3]             # shared prefixes for the prefix cache
    prompts[5] = prompts[0] + prompts[5][:2]
    lengths = [random.Random(i).randint(2, 30) for i in range(len(prompts))]
    refs = [hf_greedy(tiny, p, k) for p, k in zip(prompts, lengths)]
    return prompts, lengths, refs


def run(llm, prompts, params):
    """Requests named r0, r1, ... (the oracle finds its reference by id)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    reqs = [Request(list(p), prm, request_id=f"r{i}") for i, (p, prm) in enumerate(zip(prompts, params))]
    return reqs, llm.run(reqs)


CONFIGS = {
    "roomy": {},
    "tight-pool": {"num_blocks": 14, "block_size": 4},                 # forces preemption
    "prefix": {"enable_prefix_caching": True, "block_size": 4, "max_num_seqs": 2},
    "prefix-tight": {"enable_prefix_caching": True, "block_size": 4, "num_blocks": 16},
    "chunked": {"max_num_batched_tokens": 6, "block_size": 4},           # budget < 1 + k
}


GREEDY_CASES = [("oracle", c) for c in CONFIGS if c != "prefix"] + [
    ("draft", "tight-pool"), ("draft", "prefix-tight"), ("ngram", "roomy"), ("ngram", "prefix")]
_baselines: dict = {}


@pytest.mark.parametrize("method,config", GREEDY_CASES)
def test_greedy_equals_paged_and_hf(tiny, case, method, config):
    prompts, lengths, refs = case
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in lengths]
    if config not in _baselines:        # the plain paged engine, same options: run once
        _baselines[config] = run(LLM(tiny, engine="paged", **CONFIGS[config]), prompts, params)[1]
    base = _baselines[config]
    spec = LLM(tiny, engine="paged", speculative="draft" if method == "draft" else "ngram",
               num_speculative_tokens=3, draft_layers=1, **CONFIGS[config])
    if method == "oracle":
        spec.engine.proposer = OracleProposer({f"r{i}": r.tokens for i, r in enumerate(refs)})
    _, res = run(spec, prompts, params)
    for i, (out, b, ref) in enumerate(zip(res.outputs, base.outputs, refs)):
        assert out.finish_reason == FinishReason.LENGTH
        assert out.token_ids == b.token_ids, f"{method}/{config} request {i} differs from paged"
        assert_greedy_match(out.token_ids, ref, label=f"{method}/{config} request {i}")
    stats = res.metrics.extra["speculative"]
    assert stats["num_emitted"] <= res.metrics.output_tokens
    if method == "oracle":
        assert 0 < stats["num_accepted"] < stats["num_proposed"], stats
        assert sum(o.spec.num_accepted for o in res.outputs if o.spec) == stats["num_accepted"]
    if config == "tight-pool":
        assert res.metrics.num_preemptions > 0, "the tight pool should preempt"
    if config.startswith("prefix"):
        assert res.steps[-1].prefix_hit_tokens > 0, "the shared prefixes should hit the cache"
    assert_pool_full(spec.engine)


@pytest.fixture(scope="module")
def smol_plain(smol):
    """Copy-heavy and chat requests, a pool small enough to preempt with prefix caching on, and
    the plain paged engine's tokens for them: computed once for both methods below."""
    from minillm.workload import make_copy_workload, make_workload, to_requests

    items = make_copy_workload(3, seed=1, lengths=(24, 24)) + make_workload(
        2, seed=1, short=(16, 24), long=(16, 24))
    probe = LLM(smol, engine="paged")
    longest = max(r.prompt_len + r.params.max_tokens for r in to_requests(probe, items))
    opts = {"block_size": 8, "num_blocks": -(-longest // 8) + 6,    # the longest fits, two don't
            "enable_prefix_caching": True, "max_num_batched_tokens": 128}
    plain = LLM(smol, engine="paged", **opts)
    base = plain.run(to_requests(plain, items))
    return items, opts, [o.token_ids for o in base.outputs]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_smollm2_greedy_equals_paged(smol, smol_plain, method):
    """The real model, copy-heavy and chat requests, a pool small enough to preempt and prefix
    caching on: speculation changes no token."""
    from minillm.workload import to_requests

    items, opts, base = smol_plain
    spec = LLM(smol, engine="paged", speculative=method, num_speculative_tokens=4, **opts)
    res = spec.run(to_requests(spec, items))
    assert [o.token_ids for o in res.outputs] == base
    assert res.metrics.num_preemptions > 0 and res.steps[-1].prefix_hit_tokens > 0
    assert res.metrics.extra["speculative"]["num_accepted"] > 0
    assert_pool_full(spec.engine)


def test_speculative_and_ordinary_requests_share_batches(tiny):
    """n > 1 samples and beams decode normally beside speculating requests; every output equals
    the plain paged engine's (a tight pool preempts them too)."""
    prompts = random_prompts(6, seed=9, lo=3, hi=20)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=8, beam_width=2, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.8, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=9, ignore_eos=True),
              SamplingParams(max_tokens=11, ignore_eos=True)]
    opts = {"num_blocks": 20, "block_size": 4}
    _, base = run(LLM(tiny, engine="paged", **opts), prompts, params)
    spec = LLM(tiny, engine="paged+draft", draft_layers=2, num_speculative_tokens=4, **opts)
    _, res = run(spec, prompts, params)
    for i in (0, 1, 2, 4, 5):      # greedy and n > 1 / beams: the same tokens
        assert res.outputs[i].samples == base.outputs[i].samples, f"request {i}"
    assert res.outputs[1].spec is None and res.outputs[2].spec is None, "n > 1 / beams never speculate"
    assert res.outputs[0].spec.acceptance_rate == 1.0, "a full-depth draft is the target itself"
    assert res.metrics.num_preemptions > 0
    assert_pool_full(spec.engine)


# --- configuration, proposers, engine plumbing ----------------------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    ({"method": "medusa"}, "speculative method must be one of ngram, draft, got 'medusa'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer, got '4'"),
    ({"num_speculative_tokens": 65}, "num_speculative_tokens must be <= 64, got 65"),
    ({"prompt_lookup_min": 5}, "prompt_lookup_min \\(5\\) must be <= prompt_lookup_max \\(4\\)"),
    ({"draft_layers": 0}, "draft_layers must be an integer >= 1, got 0"),
])
def test_config_errors_name_field_and_value(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig(**kwargs)


def test_engine_options_checked(tiny):
    with pytest.raises(ValueError, match="speculative must be 'ngram' or 'draft'.*got 'eagle'"):
        LLM(tiny, engine="paged", speculative="eagle")
    with pytest.raises(ValueError, match="draft_layers must be <= the target's 2 layers, got 3"):
        LLM(tiny, engine="paged+draft", draft_layers=3)
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=2)
    llm = LLM(tiny, engine="paged", speculative=cfg)
    assert llm.engine.name == "paged+ngram" and llm.engine.speculative_config is cfg


def test_ngram_lookup():
    ng = NgramProposer(min_n=1, max_n=3)
    assert ng.lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert ng.lookup([1, 2, 3, 4, 1, 2, 5, 5, 1, 2], 2) == [5, 5], "newest occurrence first"
    assert ng.lookup([1, 2, 3], 4) == []
    assert ng.lookup([7], 4) == []


def test_abort_and_reset_free_both_pools(tiny):
    llm = LLM(tiny, engine="paged+draft", draft_layers=1, num_blocks=32, block_size=4)
    engine = llm.engine
    reqs = llm.make_requests(random_prompts(4, seed=2, lo=3, hi=12),
                             SamplingParams(max_tokens=20, ignore_eos=True))
    for r in reqs:
        engine.validate(r)
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    assert engine.abort(reqs[0].request_id)
    finals = drain(engine)
    assert finals[reqs[0].request_id] == 1 and all(finals[r.request_id] == 1 for r in reqs[1:])
    assert reqs[0].finish_reason == FinishReason.ABORT
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs[1:])
    assert_pool_full(engine)
    engine.reset()
    draft = engine.proposer.block_manager
    assert draft.num_free_blocks == draft.num_blocks


def test_cli_speculative_flags(tmp_path):
    """``--engine paged --speculative ngram --num-speculative-tokens 3``: the same tokens as
    plain paged; an unknown method is refused before generating (exit 2)."""
    import json

    from minillm.__main__ import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]}\n{"prompt": "abcabcabc"}\n')
    lines = {}
    for name, extra in (("plain", []), ("ngram", ["--speculative", "ngram",
                                                   "--num-speculative-tokens", "3",
                                                   "--prompt-lookup-min", "1"])):
        dst = tmp_path / f"{name}.jsonl"
        code = main(["generate", "--model", "tiny-llama", "--engine", "paged", "--prompts",
                     str(src), "--out", str(dst), "--max-tokens", "12", "--quiet", *extra])
        assert code == 0
        lines[name] = [json.loads(x)["token_ids"] for x in dst.read_text().splitlines()]
    assert lines["plain"] == lines["ngram"] and all(lines["plain"])
    code = main(["generate", "--model", "tiny-llama", "--engine", "paged", "--prompts", str(src),
                 "--out", str(tmp_path / "x.jsonl"), "--quiet", "--speculative", "eagle"])
    assert code == 2


@pytest.mark.slow
def test_bench_experiment_rows(tiny):
    from minillm.bench.offline import exp_speculative, format_spec_table

    rows = exp_speculative(tiny, 4, 0, {"max_num_seqs": 2, "block_size": 4}, lengths=(4, 6))["rows"]
    assert [(r["workload"], r["batch"], r["engine"]) for r in rows][:3] == \
        [("chat", 1, "paged"), ("chat", 1, "paged+ngram"), ("chat", 1, "paged+draft")]
    assert len(rows) == 12 and all(r["output_tok_s"] > 0 for r in rows)
    assert all(r["speedup_vs_paged"] == 1.0 for r in rows if r["engine"] == "paged")
    assert all(r["num_proposed"] >= r["num_accepted"] >= 0 for r in rows if r["engine"] != "paged")
    assert "| paged+draft | copy | 2 |" in format_spec_table(rows)


@pytest.mark.parametrize("method,kinds,seed", [("draft", ("n1", "nmany", "beam"), 101),
                                               ("ngram", ("n1",), 201)])
def test_soak_with_speculation(method, kinds, seed, monkeypatch):
    """The paged engine's soak test (random adds, aborts and steps on a tight pool with prefix
    caching; every operation followed by the full invariant check; the outputs compared with a
    roomy run), with every engine it builds speculating."""
    import test_soak

    model = test_soak.load_model("tiny-llama", device="cpu", dtype=torch.float64)
    real = test_soak.create_engine

    def speculating(name, m, **options):
        return real(name, m, speculative=method, num_speculative_tokens=3, draft_layers=1,
                    prompt_lookup_min=1, **options)
    monkeypatch.setattr(test_soak, "create_engine", speculating)
    torch.set_num_threads(1)
    config = test_soak.make_config(seed, 4, True, "fcfs", True, kinds)
    ops = test_soak.make_ops(config, 400, model.config.vocab_size)
    run = test_soak.run_soak(model, config, ops)
    stats = test_soak.check_run(model, run)
    assert stats["compared"] > 0 and stats["preemptions"] > 0, dict(stats)
    assert run.engine.run_stats.num_proposed > 0, "the soak should have speculated"
    assert run.engine.name == f"paged+{method}"
