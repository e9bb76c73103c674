"""The lm-evaluation-harness check (``minillm/bench/lm_eval.py``, issue 44) without lm-eval: the
bundled tasks are well-formed and ship with the package, and the Hugging Face side's scorer gives
a continuation the log-likelihood the server's echo logprobs give it, parsed the way lm-eval's
``local-completions`` parses them (``token_logprobs[ctxlen:-1]`` after ``max_tokens: 1``)."""
from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import openai
import pytest
import torch

from minillm import LLM
from minillm.bench import lm_eval as ev
from serve_util import running_server

TOL = 1e-4      # fp32 on both sides: the same arithmetic up to summation order


def test_the_bundled_tasks_are_well_formed():
    mc, gen = ev.task_docs(ev.MC_TASK), ev.task_docs(ev.GEN_TASK)
    assert 50 <= len(mc) <= 100 and 20 <= len(gen) <= 100
    for doc in mc:
        choices = doc["choices"]
        assert isinstance(doc["question"], str) and doc["question"].endswith("?")
        assert len(choices) >= 2 and len(set(choices)) == len(choices), doc
        assert all(isinstance(c, str) and c and c == c.strip() for c in choices), doc
        assert isinstance(doc["answer"], int) and 0 <= doc["answer"] < len(choices), doc
    for doc in gen:
        assert ev.last_number(doc["answer"]) == doc["answer"], doc     # the filter can match it
    assert len({d["question"] for d in mc}) == len(mc), "a question repeats"
    for task, docs in ((ev.MC_TASK, mc), (ev.GEN_TASK, gen)):
        cfg = ev.task_config(task)
        assert cfg["task"] == task and cfg["dataset_path"] == "json"
        assert cfg["test_split"] in cfg["dataset_kwargs"]["data_files"]
        for doc in docs:
            text = ev.render(cfg["doc_to_text"], doc)
            assert doc["question"] in text and "{" not in text
    kw = ev.task_config(ev.GEN_TASK)["generation_kwargs"]
    assert kw["do_sample"] is False and kw["max_gen_toks"] > 0


def test_the_task_files_ship_with_the_package():
    tomllib = pytest.importorskip("tomllib")       # Python 3.11+
    root = Path(ev.__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["minillm"]
    for path in ev.TASK_DIR.iterdir():
        rel = path.relative_to(root / "minillm").as_posix()
        assert any(fnmatch(rel, p) for p in patterns), f"{rel} is not in package-data"


class Chars:
    """A tokenizer whose tokens are characters: where the pair splits is visible."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_encode_pair_moves_the_context_s_trailing_space_to_the_continuation():
    ctx, cont = ev.encode_pair(Chars(), "Answer: ", "Paris")
    assert "".join(map(chr, ctx)) == "Answer:" and "".join(map(chr, cont)) == " Paris"
    ctx, cont = ev.encode_pair(Chars(), "Q:\nA:", " 4")
    assert "".join(map(chr, ctx)) == "Q:\nA:" and "".join(map(chr, cont)) == " 4"


def test_mc_metrics_are_lm_eval_s_acc_and_acc_norm():
    # choice 1 is the most likely in total, choice 0 per character
    lls, choices = [[-2.0, -1.5]], [["abcdefgh", "ab"]]
    assert ev.mc_metrics(lls, choices, [1]) == {"acc": 1.0, "acc_norm": 0.0}
    assert ev.mc_metrics(lls, choices, [0]) == {"acc": 0.0, "acc_norm": 1.0}


@pytest.fixture(scope="module")
def client(tiny):
    llm = LLM(tiny, engine="paged", num_blocks=64, block_size=4, max_num_batched_tokens=16)
    with running_server(llm) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)


PAIRS = [("Question: What is the capital of France?\nAnswer:", " Paris"),
         ("What is 2 + 2? ", "4"),                  # the trailing space moves over
         ("x", " a longer continuation of several tokens")]


@pytest.mark.parametrize("context,continuation", PAIRS)
def test_hf_loglikelihood_equals_the_server_s_echo_logprobs(tiny, client, context, continuation):
    """What lm-eval's local-completions sends and how it reads the answer, against the scorer the
    script's Hugging Face side uses."""
    ctx, cont = ev.encode_pair(tiny.tokenizer, context, continuation)
    want, want_greedy = ev.hf_loglikelihood(tiny.hf_model, ctx, cont)
    for max_tokens in (1, 0):            # lm-eval sends 1 (and drops the generated token's); 0
        r = client.completions.create(model="tiny-llama", prompt=[ctx + cont], echo=True,
                                      logprobs=1, max_tokens=max_tokens, temperature=0, seed=1234)
        lp = r.choices[0].logprobs
        end = len(lp.token_logprobs) - max_tokens
        got = lp.token_logprobs[len(ctx):end]
        assert len(got) == len(cont)
        assert sum(got) == pytest.approx(want, abs=TOL)
        greedy = all(v >= max(top.values()) - TOL
                     for v, top in zip(got, lp.top_logprobs[len(ctx):end]))
        assert greedy == want_greedy


def test_a_greedy_continuation_is_greedy_on_both_sides(tiny, client):
    """The greedy flag both ways on a continuation that is greedy by construction: the tiny
    model's own argmax tokens after the context (the pairs above are not greedy)."""
    ctx = tiny.tokenizer.encode("Once upon a time", add_special_tokens=False)
    cont: list[int] = []
    with torch.no_grad():
        for _ in range(4):
            logits = tiny.hf_model(torch.tensor([ctx + cont])).logits[0, -1]
            cont.append(int(logits.argmax()))
    ll, greedy = ev.hf_loglikelihood(tiny.hf_model, ctx, cont)
    r = client.completions.create(model="tiny-llama", prompt=[ctx + cont], echo=True, logprobs=1,
                                  max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    got, tops = lp.token_logprobs[len(ctx):-1], lp.top_logprobs[len(ctx):-1]
    assert greedy and all(v == max(top.values()) for v, top in zip(got, tops))
    assert sum(got) == pytest.approx(ll, abs=TOL)
