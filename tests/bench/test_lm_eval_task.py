"""The lm-evaluation-harness check (``minillm/bench/lm_eval.py``) without lm-eval: the
bundled tasks are well-formed and ship with the package; the comparison of two lm-eval runs
(``lm_eval_compare``) reads lm-eval's output files and compares them item by item (fixtures in
lm-eval 0.4.13's format); and what lm-eval's ``--model hf`` computes for a continuation (the
log-softmax of one forward over context + continuation, as ``HFLM._loglikelihood_tokens`` does)
is what the server's echo logprobs give it, parsed the way ``local-completions`` parses them
(``token_logprobs[ctxlen:-1]`` after ``max_tokens: 1``)."""
from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path

import openai
import pytest
import torch

from minillm import LLM
from minillm.bench import lm_eval as ev
from minillm.bench import lm_eval_compare as cmp
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


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) into token ids (``TemplateLM._encode_pair``):
    trailing spaces move to the continuation, the whole is encoded once (no special tokens) and
    cut after the context's tokens, so a token spanning the boundary is split alike both ways."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n_context = len(tokenizer.encode(context, add_special_tokens=False))
    return whole[:n_context], whole[n_context:]


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's log-likelihood after the context, and whether greedy decoding produces
    it: the fp32 log-softmax of one forward over ``context + continuation``."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1:-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(continuation)
    total = logprobs.gather(1, target[:, None]).sum().item()
    return total, bool((logprobs.argmax(-1) == target).all())


class Chars:
    """A tokenizer whose tokens are characters: where the pair splits is visible."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_encode_pair_moves_the_context_s_trailing_space_to_the_continuation():
    ctx, cont = encode_pair(Chars(), "Answer: ", "Paris")
    assert "".join(map(chr, ctx)) == "Answer:" and "".join(map(chr, cont)) == " Paris"
    ctx, cont = encode_pair(Chars(), "Q:\nA:", " 4")
    assert "".join(map(chr, ctx)) == "Q:\nA:" and "".join(map(chr, cont)) == " 4"


# --- two lm-eval runs side by side (lm_eval_compare), on lm-eval 0.4.13's output files ----------
def mc_sample(doc_id: int, scores: list[tuple[float, bool]], context: str = "Q?\nAnswer:") -> dict:
    """A multiple-choice line of ``samples_<task>_*.jsonl``: one request per choice, each
    response ``str()``-ed by lm-eval (``[["-1.5", "True"]]``)."""
    return {"doc_id": doc_id,
            "arguments": {f"gen_args_{i}": {"arg_0": context, "arg_1": f" c{i}"}
                          for i in range(len(scores))},
            "resps": [[[str(ll), str(greedy)]] for ll, greedy in scores],
            "filtered_resps": [[str(ll), str(greedy)] for ll, greedy in scores]}


def gen_sample(doc_id: int, text: str) -> dict:
    return {"doc_id": doc_id, "arguments": {"gen_args_0": {"arg_0": "chat", "arg_1": {}}},
            "resps": [[text]], "filtered_resps": [ev.last_number(text)]}


def write_output(out: Path, task: str, results: dict, samples: list[dict]) -> Path:
    """What ``lm_eval --output_path out --log_samples`` leaves: a folder per model."""
    d = out / "__root__model"
    d.mkdir(parents=True)
    (d / "results_2026-01-01T00-00-00.json").write_text(json.dumps({"results": {task: results}}))
    (d / f"samples_{task}_2026-01-01T00-00-00.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in samples))
    return out


MC_RESULTS = {"alias": "mc", "acc,none": 0.5, "acc_stderr,none": 0.5, "acc_norm,none": 1.0}
GEN_RESULTS = {"alias": "gen", "exact_match,last_number": 0.5}


def test_read_output_gives_the_task_s_results_and_its_samples_in_document_order(tmp_path):
    samples = [mc_sample(1, [(-2.0, False), (-1.0, True)]), mc_sample(0, [(-0.5, True)])]
    results, got = cmp.read_output(write_output(tmp_path, "t", MC_RESULTS, samples), "t")
    assert results == MC_RESULTS and [s["doc_id"] for s in got] == [0, 1]
    assert cmp.choice_scores(got[1]) == [(-2.0, False), (-1.0, True)]
    assert cmp.requests(got[1]) == [("Q?\nAnswer:", " c0"), ("Q?\nAnswer:", " c1")]
    assert cmp.metrics(results, "multiple_choice") == {"acc": 0.5, "acc_norm": 1.0}
    with pytest.raises(FileNotFoundError):
        cmp.read_output(tmp_path, "another_task")


def test_compare_mc_reports_the_largest_difference_the_flags_and_the_picks():
    ours = [mc_sample(0, [(-1.0, True), (-3.0, False)]),
            mc_sample(1, [(-2.0, False), (-1.5, True)])]
    ref = [mc_sample(0, [(-1.00003, True), (-3.0, False)]),
           mc_sample(1, [(-1.4, True), (-1.5, False)])]      # question 1: other pick and flags
    got = cmp.compare_mc(ours, ref)
    assert got["mc_questions"] == 2 and got["mc_choices"] == 4 and got["mc_same_requests"]
    assert got["mc_max_abs_loglikelihood_diff"] == pytest.approx(0.6)
    assert got["mc_greedy_flags_equal"] == 2 and got["mc_same_pick"] == 1
    other = [mc_sample(0, [(-1.0, True), (-3.0, False)], context="Other?\nAnswer:"), ref[1]]
    assert not cmp.compare_mc(ours, other)["mc_same_requests"]
    with pytest.raises(ValueError, match="different documents"):
        cmp.compare_mc(ours, ref[:1])


def test_compare_gen_lists_the_texts_that_differ():
    ours = [gen_sample(0, "13 + 1 = 14"), gen_sample(1, "3")]
    ref = [gen_sample(0, "13 + 1 = 14"), gen_sample(1, "3.")]
    assert cmp.compare_gen(ours, ref) == {
        "gen_questions": 2, "gen_texts_equal": 1,
        "gen_differing": [{"doc_id": 1, "minillm": "3", "hf": "3."}]}


def test_compare_reports_both_runs_metrics_and_the_items(capsys):
    mc, gen = [mc_sample(0, [(-1.0, True), (-2.0, False)])], [gen_sample(0, "4")]
    ours = {"mc": (MC_RESULTS, mc), "gen": (GEN_RESULTS, gen)}
    ref = {"mc": ({**MC_RESULTS, "acc,none": 0.25}, mc), "gen": (GEN_RESULTS, gen)}
    report = cmp.compare(ours, ref, {"mc": "multiple_choice", "gen": "generate_until"})
    assert report["minillm_via_lm_eval"] == {"mc": {"acc": 0.5, "acc_norm": 1.0},
                                             "gen": {"exact_match": 0.5}}
    assert report["hf_via_lm_eval"]["mc"] == {"acc": 0.25, "acc_norm": 1.0}
    items = report["items"]
    assert items["mc_max_abs_loglikelihood_diff"] == 0.0 and items["gen_texts_equal"] == 1
    cmp.print_table(report)
    out = capsys.readouterr().out
    assert "0.5000" in out and "0.2500" in out and "1/1 texts identical" in out


def test_the_hf_side_gets_the_project_s_torch_in_fp32(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert ev.torch_requirement() == "torch==2.13.0"          # no local label: pip takes its own
    # --device goes on lm-eval's command line: it passes its --device to the model as well
    assert ev.hf_model_args(Path("/m")).split(",") == ["pretrained=/m", "dtype=float32"]
    assert ev.engine_threads() >= 1


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
    """What lm-eval's local-completions sends and how it reads the answer, against what its
    ``--model hf`` computes for the same pair."""
    ctx, cont = encode_pair(tiny.tokenizer, context, continuation)
    want, want_greedy = hf_loglikelihood(tiny.hf_model, ctx, cont)
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
    ll, greedy = hf_loglikelihood(tiny.hf_model, ctx, cont)
    r = client.completions.create(model="tiny-llama", prompt=[ctx + cont], echo=True, logprobs=1,
                                  max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    got, tops = lp.token_logprobs[len(ctx):-1], lp.top_logprobs[len(ctx):-1]
    assert greedy and all(v == max(top.values()) for v, top in zip(got, tops))
    assert sum(got) == pytest.approx(ll, abs=TOL)
