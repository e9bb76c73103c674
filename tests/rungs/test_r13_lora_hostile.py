"""Rung 13 against hostile adapters and a busy slot: every malformed adapter is one
``AdapterError`` naming the adapter and what is wrong (the CLI: one ``error:`` line, exit 2);
values that would decode garbage (NaN, infinity, an absurd scale, integer tensors, no tensors,
keys that alias a layer or map to nothing) are refused when the adapter is read; a request
waiting for an adapter slot lets those behind it start, yet is itself served within a bound that
follows from ``max_lora_skips`` (on the step clock: no wall clock anywhere)."""
from __future__ import annotations

import json

import pytest
import torch

from minillm import LLM, LoRARequest, SamplingParams
from minillm.engines.r13_lora.adapter import (CONFIG_FILE, MAX_LORA_SCALE, WEIGHTS_FILE,
                                              AdapterError, load_adapter)
from minillm.engines.r13_lora.peft_files import hf_shapes, read_adapter, save_random_adapter
from minillm.request import Request

PREFIX = "base_model.model.model.layers."
Q_A = PREFIX + "0.self_attn.q_proj.lora_A.weight"
Q_B = PREFIX + "0.self_attn.q_proj.lora_B.weight"


def make(tiny, tmp_path, config=None, tensors=None, raw_config=None, raw_weights=None):
    """A rank-2 q/v adapter for the tiny model at ``tmp_path/bad``; ``config``: fields to
    overwrite, ``tensors(dict) -> dict``: an edit of its tensors; ``raw_*``: a file's bytes."""
    from safetensors.torch import load_file, save_file

    path = save_random_adapter(tmp_path / "bad", tiny.hf_model, r=2, lora_alpha=4)
    if config is not None:
        fields = json.loads((path / CONFIG_FILE).read_text())
        (path / CONFIG_FILE).write_text(json.dumps({**fields, **config}))
    if tensors is not None:
        save_file(tensors(load_file(str(path / WEIGHTS_FILE))), str(path / WEIGHTS_FILE))
    if raw_config is not None:
        (path / CONFIG_FILE).write_bytes(raw_config)
    if raw_weights is not None:
        (path / WEIGHTS_FILE).write_bytes(raw_weights)
    return LoRARequest("bad", str(path))


def refused(tiny, lora, dtype=torch.float32) -> AdapterError:
    with pytest.raises(AdapterError) as e:
        load_adapter(lora, hf_shapes(tiny.hf_model), tiny.hf_model.config.num_hidden_layers,
                     16, dtype)
    message = str(e.value)
    assert message.startswith(f"LoRA adapter 'bad' ({lora.lora_path!r}): "), message
    assert "\n" not in message
    return e.value


def renamed(old: str, new: str):
    return lambda t: {(new if k == old else k): v for k, v in t.items()}


def replaced(key: str, fn):
    return lambda t: {k: (fn(v) if k == key else v) for k, v in t.items()}


# --- item 5: a malformed adapter is one error naming it ---------------------------------------
@pytest.mark.parametrize("case,words", [
    (dict(raw_config=b"[1, 2]"), "adapter_config.json must hold a JSON object, got list"),
    (dict(raw_config=b"null"), "must hold a JSON object, got NoneType"),
    (dict(raw_config=b'"r"'), "must hold a JSON object, got str"),
    (dict(raw_config=b"{"), "adapter_config.json is not valid JSON"),
    (dict(raw_config=b"[" * 100_000), "adapter_config.json is not valid JSON"),
    (dict(raw_config=b'{"r": "\xff"}'), "adapter_config.json is not valid JSON"),
    (dict(config={"target_modules": 5}), "target_modules must be a list of module names"),
    (dict(config={"target_modules": {"q_proj": 1}}), "target_modules must be a list"),
    (dict(config={"target_modules": [5]}), "target_modules: 5 is not a module name"),
    (dict(config={"target_modules": "("}), "target_modules='(' is not a valid regex"),
    (dict(raw_weights=b"not safetensors"), "adapter_model.safetensors is not a valid safetensors"),
    (dict(raw_weights=b""), "adapter_model.safetensors is not a valid safetensors"),
])
def test_malformed_adapters_are_one_error_naming_the_adapter(tiny, tmp_path, case, words):
    assert words in str(refused(tiny, make(tiny, tmp_path, **case)))


def test_a_truncated_weights_file_is_named(tiny, tmp_path):
    lora = make(tiny, tmp_path)
    data = (tmp_path / "bad" / WEIGHTS_FILE).read_bytes()
    (tmp_path / "bad" / WEIGHTS_FILE).write_bytes(data[:-10])
    assert "not a valid safetensors file" in str(refused(tiny, lora))


def test_the_engine_and_its_requests_get_the_adapter_error(tiny, tmp_path):
    """Through ``LLM``: ``add_lora`` raises it; a request naming the adapter is refused with it."""
    lora = make(tiny, tmp_path, raw_config=b"null")
    llm = LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=4)
    with pytest.raises(AdapterError, match="'bad'.*got NoneType"):
        llm.engine.add_lora(lora)
    with pytest.raises(ValueError, match="'bad'.*got NoneType"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=lora)


def one_error_line(err: str, words: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
    assert "LoRA adapter 'bad'" in lines[0], err


@pytest.fixture
def torch_threads():
    """The CLI sets torch's thread count in this process: give it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case,words", [
    (dict(raw_config=b"[1]"), "got list"), (dict(config={"target_modules": 5}), "target_modules"),
    (dict(raw_weights=b"\x00" * 16), "not a valid safetensors file")])
def test_generate_with_a_bad_adapter_is_one_error_line(tiny, tmp_path, capsys, torch_threads,
                                                       case, words):
    from minillm.__main__ import main

    lora = make(tiny, tmp_path, **case)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "lora": "bad"}) + "\n")
    code = main(["generate", "--model", "tiny-llama", "--enable-lora", "--max-lora-rank", "4",
                 "--lora-modules", f"bad={lora.lora_path}", "--prompts", str(src), "--out",
                 str(dst), "--quiet"])
    assert code == 2
    one_error_line(capsys.readouterr().err, words)
    assert not dst.exists()


@pytest.mark.parametrize("case,words", [
    (dict(raw_config=b"null"), "got NoneType"), (dict(config={"lora_alpha": 1e308}), "1e+308")])
def test_serve_with_a_bad_adapter_is_one_error_line(tiny, tmp_path, capsys, monkeypatch,
                                                    torch_threads, case, words):
    from minillm.__main__ import main
    from minillm.serve import app
    from serve_util import free_port

    def never(*a, **k):
        raise AssertionError("the server started with a bad adapter")
    monkeypatch.setattr(app.StoppingServer, "run", never)
    lora = make(tiny, tmp_path, **case)
    code = main(["serve", "--model", "tiny-llama", "--port", str(free_port()), "--enable-lora",
                 "--max-lora-rank", "4", "--lora-modules", f"bad={lora.lora_path}"])
    assert code == 2
    one_error_line(capsys.readouterr().err, words)


# --- item 6: values that would decode garbage are refused at load -----------------------------
@pytest.mark.parametrize("alpha,words", [
    (1e308, "lora_alpha=1e+308 with r=2 gives the scale 5e+307, outside (0, 1024]"),
    (0, "lora_alpha=0 with r=2 gives the scale 0,"), (-4, "lora_alpha=-4 "), (0.0, "=0.0 "),
    (MAX_LORA_SCALE * 2 + 1, "lora_alpha=2049.0 with r=2 gives the scale 1024.5, outside"),
    (10 ** 400, "lora_alpha=an integer of 401 digits with r=2 gives the scale inf"),
    ("8", "lora_alpha must be a number, got '8'"), (True, "got True"), (None, "got None"),
    ([8], "got [8]")], ids=lambda v: str(v)[:20])
def test_an_absurd_lora_alpha_is_refused(tiny, tmp_path, alpha, words):
    assert words in str(refused(tiny, make(tiny, tmp_path, config={"lora_alpha": alpha})))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_lora_alpha_is_refused(tiny, tmp_path, text):
    """Python's json reads NaN and Infinity, which JSON itself has not."""
    lora = make(tiny, tmp_path)
    file = tmp_path / "bad" / CONFIG_FILE
    file.write_text(file.read_text().replace('"lora_alpha": 4', f'"lora_alpha": {text}'))
    assert "lora_alpha" in str(refused(tiny, lora))


@pytest.mark.parametrize("r,words", [
    (0, "r must be an integer >= 1, got 0"), (-2, "got -2"), (True, "got True"),
    (2.0, "got 2.0"), ("2", "got '2'"), (None, "got None"),
    (17, "r=17 exceeds max_lora_rank=16"),
    (10 ** 400, "r=an integer of 401 digits exceeds max_lora_rank=16")], ids=lambda v: str(v)[:20])
def test_a_bad_r_is_refused(tiny, tmp_path, r, words):
    assert words in str(refused(tiny, make(tiny, tmp_path, config={"r": r})))


def test_the_largest_scale_is_accepted(tiny, tmp_path):
    lora = make(tiny, tmp_path, config={"lora_alpha": 2 * MAX_LORA_SCALE})    # r = 2
    assert read_adapter(lora, tiny.hf_model).scale == MAX_LORA_SCALE


@pytest.mark.parametrize("key,value", [(Q_B, float("nan")), (Q_A, float("inf")),
                                       (Q_B, float("-inf"))])
def test_non_finite_weights_are_refused(tiny, tmp_path, key, value):
    def poison(t):
        t = t.clone()
        t.view(-1)[3] = value
        return t
    e = refused(tiny, make(tiny, tmp_path, tensors=replaced(key, poison)))
    assert f"tensor {key!r} holds NaN or infinity" in str(e)


def test_weights_that_overflow_the_model_s_dtype_are_refused(tiny, tmp_path):
    """Finite in fp32, infinite in fp16: as the model's dtype they would be garbage too; and the
    scale folded into B (what a slot stores) must stay finite as well."""
    big = make(tiny, tmp_path, tensors=replaced(Q_A, lambda t: t * 0 + 1e6))
    assert "overflow torch.float16" in str(refused(tiny, big, torch.float16))
    scaled = make(tiny, tmp_path, tensors=replaced(Q_B, lambda t: t * 0 + 6e4),
                  config={"lora_alpha": 8})                     # scale 4: 2.4e5 > fp16's max
    assert f"{Q_B!r}: scale 4 * it overflow" in str(refused(tiny, scaled, torch.float16))
    read_adapter(scaled, tiny.hf_model)                        # fine in fp32


@pytest.mark.parametrize("edit,words", [
    (lambda t: {}, "holds no tensors"),
    (replaced(Q_A, lambda t: t.to(torch.int32)), f"tensor {Q_A!r} is torch.int32, not floating"),
    (replaced(Q_B, lambda t: t > 0), f"tensor {Q_B!r} is torch.bool, not floating"),
    (renamed(Q_A, PREFIX + "00.self_attn.q_proj.lora_A.weight"), "layer index '00' is not "
     "canonical (it would alias layer 0)"),
    (renamed(Q_A, PREFIX + "\u0660.self_attn.q_proj.lora_A.weight"), "is not a lora_A/lora_B"),
    (renamed(Q_A, PREFIX + "+0.self_attn.q_proj.lora_A.weight"), "is not a lora_A/lora_B"),
    (renamed(Q_A, PREFIX + "0.mlp.q_proj.lora_A.weight"), "is not a lora_A/lora_B"),
    (renamed(Q_A, PREFIX + "0.self_attn.rotary.lora_A.weight"), "is not a lora_A/lora_B"),
    (renamed(Q_A, PREFIX + "0.self_attn.q_proj.lora_C.weight"), "is not a lora_A/lora_B"),
    (renamed(Q_A, PREFIX + "99.self_attn.q_proj.lora_A.weight"), "layer 99 is past this"),
    (renamed(Q_A, "model.layers.0.self_attn.q_proj.lora_A.weight"), "is not a lora_A/lora_B"),
    (lambda t: {k: v for k, v in t.items() if k != Q_B}, f"tensor {Q_A!r} has no lora_B partner"),
])
def test_tensors_that_map_to_nothing_are_refused(tiny, tmp_path, edit, words):
    assert words in str(refused(tiny, make(tiny, tmp_path, tensors=edit)))


def test_a_tensor_of_a_module_target_modules_leaves_out_is_refused(tiny, tmp_path):
    """PEFT only loads the modules ``target_modules`` names; a tensor for another one would be
    applied here and ignored there. A list and PEFT's regex form are both read."""
    e = refused(tiny, make(tiny, tmp_path, config={"target_modules": ["q_proj"]}))
    assert "does not target 'model.layers.0.self_attn.v_proj'" in str(e)
    regex = make(tiny, tmp_path, config={"target_modules": r".*\.(q|v)_proj"})
    assert read_adapter(regex, tiny.hf_model).targets == ["q_proj", "v_proj"]
    assert "does not target" in str(refused(tiny, make(tiny, tmp_path,
                                                       config={"target_modules": r".*q_proj"})))
    both = make(tiny, tmp_path, config={"target_modules": ["self_attn.q_proj", "v_proj"]})
    assert read_adapter(both, tiny.hf_model).targets == ["q_proj", "v_proj"]


# --- item 7: a request waiting for a slot blocks nobody, and is served within a bound ---------
@pytest.fixture(scope="module")
def two_adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("slot-loras")
    return [LoRARequest(name, str(save_random_adapter(root / name, tiny.hf_model, r=2, seed=i)))
            for i, name in enumerate("ab")]


def one_slot_engine(tiny, **options):
    return LLM(tiny, engine="paged", enable_lora=True, max_lora_rank=2, max_loras=1,
               **options).engine


def add(engine, rid: str, lora, max_tokens: int) -> Request:
    req = Request([5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  request_id=rid)
    req.lora_request = lora
    engine.validate(req)
    engine.add_request(req)
    return req


def test_a_base_request_is_served_while_the_slot_is_busy(tiny, two_adapters):
    """One slot, adapter a's long request A holds it, B waits for adapter b; C, a 2-token
    base-model request behind B, finishes while A still runs and B still waits."""
    a, b = two_adapters
    engine = one_slot_engine(tiny)
    A = add(engine, "A", a, 40)
    engine.step()
    B, C = add(engine, "B", b, 2), add(engine, "C", None, 2)
    for _ in range(3):                    # C's prompt step gives its first token, then one more
        engine.step()
    assert C.finished and len(C.output_token_ids) == 2
    assert not A.finished and B.output_token_ids == []
    while engine.has_unfinished() and len(A.output_token_ids) < 40:   # at most 40 steps
        engine.step()
    engine.step()
    assert A.finished and len(B.output_token_ids) == 1               # B got the slot next


def run_stream(engine, a, b, steps: int, max_tokens: int) -> tuple[Request, int | None, list]:
    """A (adapter a) holds the one slot, B waits for adapter b; each step a base-model request
    and an adapter-a request arrive behind B (the latter keep a's slot busy): run ``steps``
    steps; return B, the step (counted from B's arrival) that gave B its first token, and the
    base-model requests with the step each arrived at."""
    add(engine, "A", a, max_tokens)
    engine.step()
    B = add(engine, "B", b, 2)
    first, base = None, []
    for step in range(1, steps + 1):
        base.append((add(engine, f"base{step}", None, max_tokens), step))
        add(engine, f"a{step}", a, max_tokens)
        engine.step()
        if first is None and B.output_token_ids:
            first = step
    return B, first, base


def test_the_waiting_adapter_request_is_served_within_its_bound(tiny, two_adapters):
    """Under a steady stream of requests behind B, B gets its first token within K + m steps
    (K = max_lora_skips, m = the adapter requests' max_tokens): B is skipped in K steps, then no
    adapter request behind it starts, so a's slot drains in m steps and B takes it. Meanwhile
    every base-model request is served in arrival order, m steps after it arrived: none waits
    for B. With no bound (K past the run) B would wait for as long as the stream lasts."""
    a, b = two_adapters
    m = 8
    engine = one_slot_engine(tiny)
    K = engine.lora_config.max_lora_skips
    bound = K + m + 1                   # + 1: the step in which B's prompt runs
    B, first, base = run_stream(engine, a, b, bound + m, m)
    assert first is not None and first <= bound, (first, bound)
    for req, arrived in base:           # each base request: one token a step from arrival
        assert len(req.output_token_ids) == min(m, bound + m - arrived + 1), req.request_id
    starved = one_slot_engine(tiny, max_lora_skips=10 ** 6)
    B, first, _ = run_stream(starved, a, b, bound + m, m)
    assert first is None and B.output_token_ids == []


def test_an_aborted_starving_request_holds_nobody_back(tiny, two_adapters):
    a, b = two_adapters
    engine = one_slot_engine(tiny, max_lora_skips=0)
    add(engine, "A", a, 30)
    engine.step()
    add(engine, "B", b, 2)
    engine.step()                       # B refused once: from now on it holds back a's requests
    late = add(engine, "late", a, 2)
    engine.step()
    assert late.output_token_ids == []
    engine.abort("B")
    engine.step()
    assert len(late.output_token_ids) == 1


def test_max_lora_skips_is_checked():
    from minillm.engines.r13_lora.config import LoRAConfig
    assert LoRAConfig(enable_lora=True, max_lora_skips=0).max_lora_skips == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="max_lora_skips must be an integer"):
            LoRAConfig(enable_lora=True, max_lora_skips=bad)
