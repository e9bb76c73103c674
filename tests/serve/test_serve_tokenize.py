"""``/tokenize`` and ``/detokenize`` (serve/tokenize.py, vLLM's shapes): the ids a completion or
chat request would get, and back; errors name the field."""
from __future__ import annotations

import httpx

from serve_util import offline, server  # noqa: F401 (fixtures)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_tokenize_gives_the_ids_a_request_gets(server, offline):
    url, app = server
    name = app.state.model_name
    text = "The quick brown fox, ключ 東京"
    r = post(url, "/tokenize", {"model": name, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == offline.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == offline.model.max_model_len
    assert body["token_strs"] == [offline.tokenizer.decode([i]) for i in body["tokens"]]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = post(url, "/tokenize", {"model": name, "messages": chat})
    assert r.status_code == 200 and r.json()["tokens"] == offline.encode_chat(chat)
    assert "token_strs" not in r.json()


def test_detokenize_inverts_tokenize(server, offline):
    url, app = server
    name = app.state.model_name
    ids = offline.encode("Paged attention keeps KV in blocks.")
    r = post(url, "/detokenize", {"model": name, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": offline.tokenizer.decode(ids)}
    assert post(url, "/detokenize", {"model": name, "tokens": []}).json() == {"prompt": ""}


def test_bad_bodies_are_400s_naming_the_field(server):
    url, app = server
    name = app.state.model_name
    vocab = app.state.llm.model.config.vocab_size
    cases = [
        ("/tokenize", {"model": name}, "prompt"),                                   # neither
        ("/tokenize", {"model": name, "prompt": "a", "messages": [
            {"role": "user", "content": "b"}]}, "prompt"),                          # both
        ("/tokenize", {"model": name, "prompt": ""}, "prompt"),                     # empty
        ("/tokenize", {"model": name, "prompt": 7}, "prompt"),                      # not text
        ("/tokenize", {"model": name, "prompt": "a", "add": 1}, "add"),             # unknown
        ("/tokenize", {"model": name, "prompt": "a", "add_generation_prompt": False},
         "add_generation_prompt"),                                                 # chat only
        ("/tokenize", {"model": name, "prompt": "a", "add_special_tokens": 1},
         "add_special_tokens"),
        ("/detokenize", {"model": name, "tokens": [1, vocab]}, "tokens"),
        ("/detokenize", {"model": name, "tokens": [-1]}, "tokens"),
        ("/detokenize", {"model": name, "tokens": ["1"]}, "tokens"),
        ("/detokenize", {"model": name, "tokens": [True]}, "tokens"),
    ]
    for path, body, field in cases:
        r = post(url, path, body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert field in (err.get("param") or "") + err["message"], (path, body, err)
    # an unknown model is a 404, as OpenAI and vLLM answer it
    for path, body in (("/tokenize", {"model": "gpt-4", "prompt": "a"}),
                       ("/detokenize", {"model": "gpt-4", "tokens": [5]})):
        r = post(url, path, body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == "model_not_found", err
    # the server still serves afterwards
    assert post(url, "/tokenize", {"model": name, "prompt": "ok"}).status_code == 200


def test_tokenize_takes_vllms_special_token_and_generation_prompt_options(server, offline):
    """``add_special_tokens`` (default: true for a prompt, false for messages) and, for
    messages, ``add_generation_prompt`` (default true), as vLLM's /tokenize takes them."""
    url, app = server
    name, tok = app.state.model_name, offline.tokenizer

    def ids(body: dict) -> list[int]:
        r = post(url, "/tokenize", {"model": name, **body})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    text = "Paged attention"
    assert ids({"prompt": text}) == ids({"prompt": text, "add_special_tokens": True}) \
        == tok.encode(text, add_special_tokens=True)
    assert ids({"prompt": text, "add_special_tokens": False}) == \
        tok.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) != tok.encode(text, add_special_tokens=False)
    chat = [{"role": "user", "content": "Hi"}]
    asked = ids({"messages": chat})
    assert asked == offline.encode_chat(chat) == ids({"messages": chat,
                                                      "add_generation_prompt": True})
    bare = ids({"messages": chat, "add_generation_prompt": False})
    assert bare == tok.apply_chat_template(chat, add_generation_prompt=False, tokenize=True)
    assert asked[:len(bare)] == bare and len(asked) > len(bare)   # the assistant's header
    bos = tok.encode("", add_special_tokens=True)
    assert ids({"messages": chat, "add_special_tokens": True}) == bos + asked
