"""``bench --serve minillm,vllm-cpu``: servers started by the benchmark itself, one at a time, the
same requests sent to each, every server process gone afterwards. vLLM itself is not installed in
CI: a second minillm server stands in for it (the same command path, another name)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from minillm.__main__ import main
from minillm.bench import compare
from minillm.bench.client import RANDOM_IDS, make_bodies

pytestmark = pytest.mark.slow      # servers started as processes: not in make test-fast


def alive(pgid: int) -> bool:
    return bool(compare.group_members(pgid))


@pytest.fixture
def spawned(monkeypatch):
    """Record every server process the comparison starts."""
    pids, real = [], subprocess.Popen

    def popen(*a, **kw):
        p = real(*a, **kw)
        pids.append(p.pid)
        return p
    monkeypatch.setattr(compare.subprocess, "Popen", popen)
    return pids


def test_two_servers_get_the_same_requests(tmp_path, monkeypatch, spawned, capsys):
    real = compare.server_command
    monkeypatch.setattr(compare, "server_command",
                        lambda name, *a: real("minillm", *a))      # vllm-cpu's stand-in
    out = tmp_path / "cmp.json"
    rc = main(["bench", "--serve", "minillm,vllm-cpu,offline", "--model", "tiny-llama", "--rate", "50",
               "--requests", "6", "--max-tokens", "16", "--ignore-eos", "--max-batch", "4",
               "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    a, b, c = (got["servers"][n] for n in ("minillm", "vllm-cpu", "offline"))
    assert a["completed"] == b["completed"] == c["completed"] == 6
    assert a["failed"] == b["failed"] == c["failed"] == 0
    assert a["total_output_tokens"] == b["total_output_tokens"] == c["total_output_tokens"] == 96
    assert a["total_input_tokens"] == b["total_input_tokens"] == c["total_input_tokens"] > 0
    assert c["median_ttft_ms"] > 0 and c["median_tpot_ms"] > 0   # the engine's own times
    # each server's /metrics counter: 6 short requests in a roomy pool evict nobody
    assert a["preemptions"] == b["preemptions"] == 0 and "preemptions" not in c
    assert isinstance(a["timeline"], list) and "timeline" not in c   # polled /metrics (servers)
    assert got["max_num_seqs"] == 4 and got["environment"]["minillm_torch_threads"] >= 1
    assert "offline" in capsys.readouterr().out
    assert len(spawned) >= 2 and not any(alive(p) for p in spawned)   # both servers (and any
    # other child the run started) are gone
    assert (tmp_path / "server-logs" / "server-minillm.log").exists()


def test_a_server_that_dies_on_start_is_a_clear_error(tmp_path, monkeypatch, spawned, capsys):
    monkeypatch.setattr(compare, "server_command", lambda *a: (
        [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"], {}))
    rc = main(["bench", "--serve", "minillm", "--model", "tiny-llama", "--requests", "2",
               "--json", str(tmp_path / "x.json")])
    out = capsys.readouterr().out
    assert rc == 1
    assert "exited with code 3 before it answered /health" in out and "no model here" in out
    assert not any(alive(p) for p in spawned)


def test_stop_ends_the_whole_process_group():
    """vLLM's server runs an engine process beside its front-end: both must go."""
    p = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"], start_new_session=True)
    time.sleep(0.2)
    compare.stop(p, grace_s=5)
    assert p.poll() is not None and not alive(p.pid)


@pytest.mark.parametrize("serve", ["nope", "minillm,minillm", ","])
def test_bad_server_names_are_refused(serve, capsys):
    assert main(["bench", "--serve", serve, "--model", "tiny-llama"]) == 2
    assert "distinct server names from minillm, vllm-cpu, minillm:POLICY or minillm:ENGINE (and " \
        "offline" in \
        capsys.readouterr().out


def test_engine_options_in_a_server_name_become_its_flags():
    """``/OPTION=VALUE`` after a server name: a valued option is passed as it is; a switch
    (``async-scheduling``) is its bare flag when true, nothing when false; a bad one is a
    ValueError naming it."""
    assert compare.split_name("minillm:slo/slo-margin-ms=50") == \
        ("minillm", ["--policy", "slo", "--slo-margin-ms", "50"])
    assert compare.split_name("minillm/async-scheduling=true") == \
        ("minillm", ["--async-scheduling"])
    assert compare.split_name("minillm/async-scheduling=False") == ("minillm", [])
    for bad, says in (("minillm/async-scheduling=yes", "async-scheduling is true or false"),
                      ("minillm/no-such-option=1", "bad engine option 'no-such-option=1'"),
                      ("minillm/async-scheduling", "write /OPTION=VALUE")):
        with pytest.raises(ValueError, match=says):
            compare.split_name(bad)


def test_input_len_prompts_are_random_token_ids():
    a = make_bodies("m", 5, 8, seed=1, chat=False, ignore_eos=True, input_len=128)
    assert a == make_bodies("m", 5, 8, seed=1, chat=False, ignore_eos=True, input_len=128)
    assert all(len(b["prompt"]) == 128 and set(b["prompt"]) <= set(RANDOM_IDS) for b in a)
    tiny = make_bodies("tiny-llama", 5, 8, seed=1, chat=False, ignore_eos=True, input_len=64)
    assert all(0 <= i < 512 for b in tiny for i in b["prompt"])
    assert len({tuple(b["prompt"]) for b in a}) == 5 and all(b["ignore_eos"] for b in a)
    assert main(["bench", "--serve", "minillm", "--input-len", "8", "--endpoint", "chat"]) == 2
    assert main(["bench", "--serve", "minillm", "--input-len", "0"]) == 2


def test_the_engine_loop_computes_with_the_threads_it_is_given(tiny):
    """``serve`` loads the model on one torch thread and gives the engine loop all of them (one
    OpenMP team: see serve/cli.py); the loop thread sets its count when it starts."""
    import asyncio

    import torch

    from minillm import LLM, SamplingParams
    from minillm.request import Request
    from minillm.serve.loop import EngineLoop

    llm = LLM(tiny, engine="paged")
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2            # a count the process does not have already
    seen = []
    loop = EngineLoop(llm.engine, threads=want)
    loop.on_step.append(lambda lp, out: seen.append(torch.get_num_threads()))

    async def one():
        q = loop.submit(Request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
        while (await q.get()).kind != "done":
            pass
    try:
        loop.start()
        asyncio.run(one())
    finally:
        loop.shutdown()
        torch.set_num_threads(before)     # torch's count is process-wide: restore it
    assert seen and set(seen) == {want}


def test_mixed_workload_compares_policies_per_class(tmp_path, monkeypatch, spawned, capsys):
    """``--mix`` against two policies of minillm's server: the same classes and bodies reach both,
    each gets the per-class report (TTFT/TPOT, goodput), the servers run with --policy."""
    from minillm.bench import mixed

    monkeypatch.setitem(mixed.MIXES, "policies", (
        mixed.RequestClass("interactive", 0, 6, 4, 60000.0),
        mixed.RequestClass("batch", 1, 24, 12, 1e-3)))
    out = tmp_path / "mix.json"
    rc = main(["bench", "--serve", "minillm:fcfs,minillm:priority", "--mix", "--model",
               "tiny-llama", "--rate", "50", "--requests", "8", "--max-batch", "2",
               "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    for name in ("minillm:fcfs", "minillm:priority"):
        c = got["servers"][name]["classes"]
        assert c["interactive"]["requests"] + c["batch"]["requests"] == 8
        assert c["interactive"]["completed"] == c["interactive"]["requests"]
        assert c["interactive"]["met_slo"] == c["interactive"]["requests"]   # 60 s objective
        assert c["batch"]["met_slo"] == 0                                   # 1 µs objective
        assert c["all"]["output_tok_s"] > 0
    assert got["classes"][0]["name"] == "interactive"
    logs = {p.name: p.read_text() for p in (tmp_path / "server-logs").iterdir()}
    assert set(logs) == {"server-minillm-fcfs.log", "server-minillm-priority.log"}
    printed = capsys.readouterr().out
    assert "| minillm:priority | interactive (p0" in printed
    assert main(["bench", "--serve", "minillm:lifo", "--mix"]) == 2
    assert main(["bench", "--serve", "minillm:score,offline", "--mix"]) == 2
    assert not any(alive(p) for p in spawned)


def test_disagg_mix_compares_one_engine_with_two_workers(tmp_path, monkeypatch, spawned, capsys):
    """``--serve minillm,minillm:disagg --mix disagg``: steady and long requests reach the paged
    server and the disaggregated one (started with --engine disagg, its prefill worker a child
    of the server's process group); each gets the per-class report; nothing is left running."""
    from minillm.bench import mixed

    monkeypatch.setitem(mixed.MIXES, "disagg", (
        mixed.RequestClass("steady", 0, 6, 12, 60000.0, 0.5, slo_tpot_ms=60000.0),
        mixed.RequestClass("long", 0, 40, 2, 1e-3, 0.5)))
    out = tmp_path / "disagg.json"
    rc = main(["bench", "--serve", "minillm,minillm:disagg", "--mix", "disagg", "--model",
               "tiny-llama", "--rate", "50", "--requests", "8", "--max-batch", "4",
               "--json", str(out)])
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["mix"] == "disagg" and [c["name"] for c in got["classes"]] == ["steady", "long"]
    a, b = got["servers"]["minillm"], got["servers"]["minillm:disagg"]
    assert a["completed"] == b["completed"] == 8
    assert a["total_output_tokens"] == b["total_output_tokens"]
    for m in (a, b):
        c = m["classes"]
        assert c["steady"]["requests"] + c["long"]["requests"] == 8
        assert c["steady"]["met_slo"] == c["steady"]["requests"]   # 60 s objectives
        assert c["long"]["met_slo"] == 0                            # 1 µs objective
        assert c["steady"]["itl_p99_ms"] >= c["steady"]["itl_p50_ms"] > 0
    logs = (tmp_path / "server-logs" / "server-minillm-disagg.log").read_text()
    assert "(disagg engine)" in logs
    assert "| minillm:disagg | long (p0, TTFT ≤ 1e-06 s) |" in capsys.readouterr().out
    assert main(["bench", "--serve", "minillm:static", "--mix", "disagg"]) == 2   # not servable
    assert not any(alive(p) for p in spawned)


def test_metric_values_sums_a_name_over_its_labels():
    text = ("# HELP x a counter\n# TYPE x counter\n"
            'x{model_name="m",reason="stop"} 3\nx{model_name="m",reason="length"} 4.5\n'
            "y 2\nvllm:num_preemptions_total{a=\"b\"} 7\n")
    assert compare.metric_values(text) == {"x": 7.5, "y": 2.0, "vllm:num_preemptions_total": 7.0}


def test_a_server_whose_requests_all_failed_gets_n_a_not_a_crash():
    """The table still prints when one server answered nothing (its throughput 0, its times
    NaN): the comparison says n/a where a ratio has no meaning."""
    nan = float("nan")
    ok = {"completed": 96, "failed": 0, "output_throughput": 200.0, "request_throughput": 3.1,
          "median_ttft_ms": 100.0, "p99_ttft_ms": 150.0, "median_tpot_ms": 40.0,
          "p99_tpot_ms": 50.0, "median_itl_ms": 38.0, "median_e2el_ms": 2700.0, "preemptions": 0}
    failed = {**ok, "completed": 0, "failed": 96, "output_throughput": 0.0,
              **{k: nan for k in ok if k.endswith("_ms")}}
    table = compare.side_by_side({"a": failed, "b": ok}).splitlines()
    assert table[-1] == ("a / b: output tok/s n/a, TTFT P50 n/a, TTFT P99 n/a, TPOT P50 n/a "
                         "(lower is better for times)")
    assert compare.side_by_side({"a": ok, "b": ok}).splitlines()[-1].startswith(
        "a / b: output tok/s 1.00x, TTFT P50 1.00x")
