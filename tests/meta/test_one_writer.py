"""One commit point: generated tokens land only through ``Request.commit`` (the request's samples,
stop checks, first-token time) and ``StepCommit._append`` in core/commit.py (the sequence's tokens), whatever the rung.

The scan reads the package's source: a new ``seq.token_ids.append`` or ``first_token_time = ...``
anywhere else is a second writer, the bug this test exists to stop (tokens, finish reasons and
TTFT computed two ways drift apart)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import minillm
from minillm import LLM, FinishReason, SamplingParams
from minillm.request import Request

PACKAGE = Path(minillm.__file__).parent
TOKEN_FIELDS = {"token_ids", "output_token_ids"}
# Where writing these is the job: the commit point itself.
WRITERS = {("request.py", "commit"), ("request.py", "set_final"), ("core/commit.py", "_append")}
# Not generated tokens of a request: each listed with why.
ALLOWED = {
    ("engines/r6_speculative/proposers.py", "propose"),  # the draft model's private scratch copy
    ("serve/detok.py", "add"),                            # the detokenizer's own buffer (text)
}
ALLOWED_DIRS = ("lab/",)   # exercises and graders build sequences by hand to test the allocator


def _writes(tree: ast.AST):
    """(function name, line, what) for every write of a token list, first_token_time or outputs."""
    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        for node in ast.walk(func):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "first_token_time":
                    yield func.name, node.lineno, "first_token_time ="
                if isinstance(t, ast.Attribute) and t.attr == "outputs" and \
                        isinstance(t.value, ast.Name) and t.value.id in ("self", "req", "request"):
                    yield func.name, node.lineno, "outputs ="
                if isinstance(node, ast.AugAssign) and isinstance(t, ast.Attribute) \
                        and t.attr in TOKEN_FIELDS:
                    yield func.name, node.lineno, f"{t.attr} +="
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("append", "extend", "insert") \
                    and isinstance(node.func.value, ast.Attribute) \
                    and node.func.value.attr in TOKEN_FIELDS:
                yield func.name, node.lineno, f"{node.func.value.attr}.{node.func.attr}"


def test_generated_tokens_have_one_writer():
    strays = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ALLOWED_DIRS):
            continue
        for func, line, what in _writes(ast.parse(path.read_text(encoding="utf-8"))):
            if (rel, func) not in WRITERS | ALLOWED:
                strays.append(f"minillm/{rel}:{line} {func}: {what}")
    assert not strays, "tokens written outside the commit point:\n" + "\n".join(strays)


def test_the_scan_sees_a_second_writer():
    """The scan is not vacuous: each kind of write it forbids is found in a snippet."""
    code = ("def step(seq, req):\n    seq.token_ids.append(1)\n    req.first_token_time = 0\n"
            "    seq.token_ids += [2]\n    req.outputs = []\n")
    found = {what for _, _, what in _writes(ast.parse(code))}
    assert found == {"token_ids.append", "first_token_time =", "token_ids +=", "outputs ="}


def test_commit_stops_at_the_first_stop_and_says_why():
    req = Request([1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    assert req.commit(0, [4, 7, 5], eos_ids={9}, max_model_len=100, now=1.5) == (2, FinishReason.STOP)
    assert req.output_token_ids == [4, 7] and req.first_token_time == 1.5
    assert req.outputs[0].finish_reason == FinishReason.STOP
    req2 = Request([1], SamplingParams(max_tokens=2))
    assert req2.commit(0, [4, 5, 6], eos_ids=set(), max_model_len=100) == (2, FinishReason.LENGTH)
    assert req2.commit(2, [8], eos_ids=set(), max_model_len=100) == (1, None)   # sample 2 forks
    assert req2.samples == [[4, 5], [], [8]]
    assert req2.commit(None, [3], eos_ids=set(), max_model_len=100) == (0, None)  # a beam step


@pytest.mark.parametrize("engine", ["paged", "paged+ngram"])
def test_each_sample_ends_with_its_own_reason(tiny, engine):
    """n = 4 sampled with a stop token: some samples stop, others reach max_tokens; each
    sample's reason is what its own tokens say, in the request and in its output."""
    llm = LLM(tiny, engine=engine, num_blocks=64, block_size=4)
    params = dict(max_tokens=12, temperature=1.0, seed=3, n=4, ignore_eos=True)
    first = llm.generate([[5, 6, 7, 8]], SamplingParams(**params))[0]
    stop = first.samples[1][2]       # a token sample 1 produced: with it as a stop token, it stops
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(**params, stop_token_ids=[stop]))[0]
    assert len(out.samples) == len(out.finish_reasons) == 4
    for ids, reason in zip(out.samples, out.finish_reasons):
        if stop in ids:
            assert reason == FinishReason.STOP and ids.index(stop) == len(ids) - 1
        else:
            assert reason == FinishReason.LENGTH and len(ids) == 12
    assert FinishReason.STOP in out.finish_reasons
    assert out.token_ids == out.samples[0]
