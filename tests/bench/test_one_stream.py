"""Rung 14's one-stream bench (bench/one_stream.py): its product lines name every way this host
can compute a product (and only those), and its table compares variants on the same tokens."""
from __future__ import annotations

import pytest
import torch

from minillm.bench import one_stream
from minillm.layers import gemv, tiled
from minillm.layers.quant import has_int8pack_kernel, w8a8_missing


@pytest.mark.parametrize("rows", [1, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_lines_are_the_ways_this_host_has(rows, dtype):
    times = one_stream.product_times(out_features=16, in_features=64, copies=2, repeats=1,
                                     rows=rows, dtype=dtype)
    fp32 = dtype == torch.float32
    want = {"F.linear", "int8 dequant"}
    want |= {"int8 int8pack"} if has_int8pack_kernel() else set()
    want |= {"w8a8 _int_mm"} if w8a8_missing() is None and fp32 else set()
    if gemv.load() is not None and rows <= gemv.MAX_ROWS:       # decode rows only
        want |= {"gemv", "gemv int8"}
        want |= {"gemv w8a8"} if gemv.load().has_vnni() and fp32 else set()
    want |= {"tiled"} if dtype in tiled.dtypes() else set()
    assert want <= set(times) <= want | {"onednn packed"}
    assert all(us > 0 for us in times.values())


def test_table_compares_variants_on_the_same_tokens(tiny):
    rows = one_stream.measure(tiny, ("eager", "gemv", "int8"), new_tokens=6, runs=1,
                              progress=None)
    assert [r["variant"] for r in rows] == ["eager", "gemv", "int8"]
    assert rows[1]["same_tokens_as_first"]          # gemv: fp32, the eager engine's tokens
    assert [r["weights"] for r in rows] == ["float32", "float32", "int8"]
    table = one_stream.format_table(rows).splitlines()
    assert len(table) == 5 and table[2].startswith("| eager | float32 | float32 |")
    assert "| 1.00x |" in table[2]


@pytest.mark.skipif(gemv.load() is None, reason="no gemv kernel")
def test_page_times_cover_a_steps_int8_products(tiny):
    c = tiny.config
    t = one_stream.page_times(c, passes=1)
    d = c.hidden_size // c.num_attention_heads
    per_layer = ((c.num_attention_heads + 2 * c.num_key_value_heads) * d * c.hidden_size
                 + c.hidden_size * c.num_attention_heads * d + 3 * c.intermediate_size * c.hidden_size)
    assert t["MB"] == pytest.approx((per_layer * c.num_hidden_layers
                                     + c.vocab_size * c.hidden_size) / 1e6)
    assert t["4 KiB pages"] > 0 and t["huge pages"] > 0


def test_the_cli_answers_another_prompt(capsys):
    assert one_stream.main(["--model", "tiny-llama", "--variants", "eager,gemv", "--runs", "1",
                            "--new-tokens", "4", "--prompt", "a prompt of the user's own"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in table[1:]] == ["| eager", "| gemv"]


def test_requests_timed_on_another_thread_run_there_and_give_the_same_tokens(tiny, monkeypatch):
    """``--on-another-thread``: every timed request runs on a thread that is not the caller's
    (the warm-up stays on it), with the same tokens as on the caller's thread."""
    import threading
    calls = []
    real = one_stream.one_run

    def spy(llm, prompt, new_tokens):
        tps, tokens = real(llm, prompt, new_tokens)
        calls.append((threading.current_thread() is threading.main_thread(), new_tokens, tokens))
        return tps, tokens

    monkeypatch.setattr(one_stream, "one_run", spy)
    one_stream.measure(tiny, ("eager",), new_tokens=5, runs=2, progress=None)
    one_stream.measure(tiny, ("eager",), new_tokens=5, runs=2, progress=None, elsewhere=True)
    assert [(main, n) for main, n, _ in calls] == [(True, 4), (True, 5), (True, 5),
                                                   (True, 4), (False, 5), (False, 5)]
    timed = [tokens for _, n, tokens in calls if n == 5]
    assert len(timed[0]) == 5 and all(t == timed[0] for t in timed)
    assert one_stream.main(["--model", "tiny-llama", "--variants", "eager", "--runs", "1",
                            "--new-tokens", "3", "--on-another-thread"]) == 0


@pytest.mark.parametrize("flags, says", [
    (["--compile-wrapper", "cpp"], "--compile-wrapper applies to the compiled step: add --compile"),
    (["--compile", "--compile-wrapper", "java"], "invalid choice: 'java'"),
    (["--kv", "f8"], "invalid choice: 'f8'"),
])
def test_llamacpp_peer_refuses_a_wrapper_before_it_builds_anything(flags, says, capsys):
    """A wrong ``--compile-wrapper`` is refused by argparse, before llama.cpp is built (minutes)."""
    from minillm.bench import llamacpp_peer

    with pytest.raises(SystemExit) as e:
        llamacpp_peer.main(flags)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["16-bit", "model"])
@pytest.mark.parametrize("dtype,kind", [("float32", "f32"), ("bfloat16", "bf16"),
                                        ("float32", "q8_0")])
def test_both_engines_store_kv_in_as_many_bytes(policy, dtype, kind):
    """``--kv``: minillm's pool and llama.cpp's cache hold a K/V number in the same bytes."""
    import torch

    from minillm.bench.llamacpp_peer import kv_types
    from minillm.layers.kv_quant import get_format

    ours, theirs = kv_types(policy, dtype, kind)
    width = get_format(ours).storage_dtype(getattr(torch, dtype)).itemsize
    assert width == {"f16": 2, "bf16": 2, "f32": 4}[theirs]
    assert (width == 2) == (policy == "16-bit" or dtype == "bfloat16")
