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
        assert status == 400 and body["error"]["param"] == "model"
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
