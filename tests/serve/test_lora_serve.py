"""Rung 13 served: ``--lora-modules name=path``; a request's ``model`` picks the base model or an
adapter and gets the tokens ``LLM.generate`` gives with that adapter; ``/v1/models`` lists them
all; an unknown name, a bad item or an engine without ``enable_lora`` is refused naming it."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from minillm import LLM, LoRARequest, SamplingParams
from minillm.engines.r13_lora.peft_files import save_random_adapter
from minillm.serve.lora import parse_lora_modules
from serve_util import running_server

PROMPTS = ["The paged engine", "Adapters share one batch"]


@pytest.fixture(scope="module")
def modules(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-loras")
    return {name: LoRARequest(name, str(save_random_adapter(
        root / name, tiny.hf_model, r=4, lora_alpha=8, targets=("q_proj", "v_proj", "down_proj"),
        use_rslora=False, seed=seed))) for seed, name in enumerate(("sql", "chat"))}


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_each_model_name_gets_its_adapter_s_tokens(tiny, modules):
    want = {}
    offline = LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for name in (None, "sql", "chat"):
        outs = offline.generate(PROMPTS, params, lora_request=modules.get(name), progress=False)
        want[name] = [o.token_ids for o in outs]
    assert want["sql"] != want[None] and want["chat"] != want[None]
    llm = LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=4, max_loras=1)
    with running_server(llm, lora_modules=modules) as (base, app):
        served = app.state.model_name
        with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
            cards = json.loads(r.read())["data"]
        assert [c["id"] for c in cards] == [served, "sql", "chat"]
        assert [c.get("parent") for c in cards] == [None, served, served]
        for name in (None, "chat", "sql", "chat"):          # one slot: adapters swap
            for prompt, ids in zip(PROMPTS, want[name]):
                status, body = post(base, "/v1/completions", {
                    "model": name or served, "prompt": prompt, "max_tokens": 8,
                    "ignore_eos": True, "temperature": 0, "return_token_ids": True})
                assert status == 200, body
                assert body["model"] == (name or served)
                assert body["choices"][0]["token_ids"] == ids, name
        status, body = post(base, "/v1/completions", {"model": "sq1", "prompt": "x"})
        assert status == 404 and body["error"]["param"] == "model"
        assert "'sq1' does not exist" in body["error"]["message"] and "'sql'" in body["error"]["message"]
        status, body = post(base, "/tokenize", {"model": "sql", "prompt": "hello"})
        assert status == 200 and body["count"] > 0
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_bad_lora_modules_are_named(tiny, modules, tmp_path):
    for item, why in (("sql", "takes name=path"), ("=x", "takes name=path")):
        with pytest.raises(ValueError, match=why):
            parse_lora_modules([item])
    with pytest.raises(ValueError, match="names 'a' twice"):
        parse_lora_modules(["a=x", "a=y"])
    from minillm.serve.app import create_app
    with pytest.raises(ValueError, match="enable_lora=True"):
        create_app(LLM(tiny, engine="paged"), lora_modules=modules)
    missing = {"gone": LoRARequest("gone", str(tmp_path / "nothing-here"))}
    with pytest.raises(ValueError, match="nothing-here"):
        create_app(LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=4),
                   lora_modules=missing)


def test_generate_jsonl_lines_name_their_adapter(tiny, modules, tmp_path):
    """``python -m minillm generate --enable-lora --lora-modules ...``: a line's "lora" picks the
    adapter (tokens equal ``LLM.generate`` with it); an unknown name is that line's error; the
    sampler's controls ride on the line too (a +100 logit_bias makes greedy pick that token)."""
    import subprocess
    import sys

    lines = [{"id": "base", "prompt": PROMPTS[0]}, {"id": "sql", "prompt": PROMPTS[0], "lora": "sql"},
             {"id": "chat", "prompt": PROMPTS[1], "lora": "chat"},
             {"id": "typo", "prompt": PROMPTS[0], "lora": "sq1"},
             {"id": "bias", "prompt": PROMPTS[1], "logit_bias": {"7": 100}, "lora": "sql"}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    r = subprocess.run([sys.executable, "-m", "minillm", "generate", "--model", "tiny-llama",
                        "--dtype", "float32", "--enable-lora", "--max-lora-rank", "4",
                        "--lora-modules", *(f"{n}={m.lora_path}" for n, m in modules.items()),
                        "--prompts", str(src), "--out", str(dst), "--max-tokens", "6", "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]          # one line failed: the typo
    rows = {row["id"]: row for row in map(json.loads, dst.read_text().splitlines())}
    assert "'sq1' is not an adapter of --lora-modules (sql, chat)" in rows["typo"]["error"]
    llm = LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=4)
    params = SamplingParams(max_tokens=6)
    for key, prompt, lora in (("base", PROMPTS[0], None), ("sql", PROMPTS[0], "sql"),
                              ("chat", PROMPTS[1], "chat")):
        out = llm.generate([prompt], params, lora_request=modules.get(lora))[0]
        assert rows[key]["token_ids"] == out.token_ids, key
    assert set(rows["bias"]["token_ids"]) == {7}


def test_a_served_mixed_batch_equals_hugging_face_on_each_merged_model(tiny, tmp_path):
    """The mixed-batch check of tests/rungs/test_r13_lora.py, served: the base model and three
    adapters of different ranks and target modules, two slots, requests sent at once (they share
    steps); each answer equals Hugging Face ``generate`` on that adapter's merged model (fp32,
    token for token, or a proven near-tie)."""
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from conftest import assert_greedy_match, hf_greedy, random_prompts
    from minillm.engines.r13_lora.peft_files import merged_model, read_adapter
    from test_r13_lora import ADAPTERS

    loras, models = {}, {None: tiny}
    for seed, (name, (r, targets, rslora)) in enumerate(ADAPTERS.items()):
        loras[name] = LoRARequest(name, str(save_random_adapter(
            tmp_path / name, tiny.hf_model, r=r, lora_alpha=2 * r, targets=targets,
            use_rslora=rslora, seed=seed)))
        models[name] = dataclasses.replace(
            tiny, hf_model=merged_model(tiny.hf_model, read_adapter(loras[name], tiny.hf_model)))
    names = [None, *ADAPTERS] * 2
    prompts = random_prompts(len(names), seed=21, hi=24)
    llm = LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=8, max_loras=2)
    with running_server(llm, lora_modules=loras) as (base, app):
        served = app.state.model_name
        ask = lambda i: post(base, "/v1/completions", {
            "model": names[i] or served, "prompt": prompts[i], "max_tokens": 8,
            "ignore_eos": True, "temperature": 0, "return_token_ids": True})
        with ThreadPoolExecutor(len(names)) as pool:
            answers = list(pool.map(ask, range(len(names))))
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        assert llm.engine.describe()["lora_evictions"] >= 1     # three adapters, two slots
    for i, (status, body) in enumerate(answers):
        assert status == 200, body
        assert_greedy_match(body["choices"][0]["token_ids"], hf_greedy(models[names[i]], prompts[i], 8),
                            label=str(names[i]))
