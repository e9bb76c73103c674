"""The command line: generate from JSONL (bad lines get error lines), and a tiny bench run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_lines(err: str) -> list[str]:
    """What a run printed on stderr, without the one line a CPU with no native bf16 prints once
    per process when ``--dtype auto`` resolves (which test meets it first depends on the order)."""
    return [line for line in err.splitlines() if not line.startswith("minillm: dtype auto:")]


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "minillm", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_generate_jsonl_with_bad_lines(tmp_path):
    lines = [
        json.dumps({"id": "a", "prompt": "hello", "max_tokens": 5}),
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}]}),
        "{not json",
        json.dumps({"id": "c", "prompt": "x", "colour": "red"}),
        json.dumps({"id": "d", "prompt": "x", "max_tokens": "five"}),
        json.dumps({"id": "e", "prompt": ""}),
        json.dumps({"id": "f", "prompt_token_ids": [5, 6, 7], "temperature": -1}),
        json.dumps({"id": "g", "prompt_token_ids": [5, 6, 7]}),
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    r = run_cli("generate", "--engine", "paged", "--model", "tiny-llama", "--prompts", str(src),
                "--out", str(dst), "--max-tokens", "3", "--quiet")
    assert r.returncode == 1, r.stderr   # some lines failed
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", "b", 3, "c", "d", "e", "f", "g"]
    ok = {o["id"]: o for o in out if "error" not in o}
    assert set(ok) == {"a", "b", "g"}
    assert len(ok["a"]["token_ids"]) <= 5 and len(ok["g"]["token_ids"]) <= 3
    assert {"text", "finish_reason", "ttft_s", "latency_s"} <= set(ok["a"])
    errors = {o["id"]: o["error"] for o in out if "error" in o}
    assert "line 3" in errors[3] and "invalid JSON" in errors[3]
    assert "unknown field(s) colour" in errors["c"]
    assert "'max_tokens' has the wrong type" in errors["d"]
    assert "line 6" in errors["e"] and "empty prompt" in errors["e"]
    assert "temperature must be >= 0" in errors["f"]


def test_generate_unknown_engine_fails_cleanly(tmp_path):
    r = run_cli("generate", "--engine", "warp", "--prompts", "x", "--out", "y")
    assert r.returncode == 2 and "invalid choice: 'warp'" in r.stderr


@pytest.mark.slow      # five engines in a subprocess (~15 s)
def test_bench_tiny_end_to_end(tmp_path):
    out = tmp_path / "bench.json"
    r = run_cli("bench", "--model", "tiny-llama", "--engines", "naive,static,dynamic,paged",
                "--requests", "8", "--naive-requests", "2", "--json", str(out), "--no-figure",
                "--experiments", "prefix,parallel,capacity")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = {row["engine"]: row for row in res["table"]}
    assert set(rows) == {"naive", "static", "dynamic", "paged", "paged-kv-budget"}
    # the KV bytes the contiguous engines' rows need at their longest: more requests fit at once
    assert rows["paged-kv-budget"]["peak_concurrency"] >= rows["paged"]["peak_concurrency"]
    for row in rows.values():
        assert row["output_tokens"] > 0 and row["output_tok_s"] > 0 and row["num_errors"] == 0
    assert rows["naive"]["num_requests"] == 2 and rows["paged"]["num_requests"] == 8
    assert rows["paged"]["kv_waste_pct"] < rows["static"]["kv_waste_pct"]
    exp = res["experiments"]
    assert exp["prefix"]["on"]["prefill_tokens_computed"] < exp["prefix"]["off"]["prefill_tokens_computed"]
    assert exp["parallel"]["n4"]["peak_blocks"] < exp["parallel"]["independent"]["peak_blocks"]
    assert exp["capacity"]["paged_peak_concurrency"] > exp["capacity"]["reservation_concurrency"]
    assert "| engine | tok/s |" in r.stdout


# --- generate: bad input, bad --out, atomic output, Ctrl-C --------------------------------------
def generate(tmp_path, data: bytes, *extra, out=None):
    """Run ``generate`` in this process on input ``data``: (exit code, out path)."""
    from minillm.__main__ import main

    src, dst = tmp_path / "in.jsonl", out or tmp_path / "out.jsonl"
    src.write_bytes(data)
    code = main(["generate", "--model", "tiny-llama", "--prompts", str(src), "--out", str(dst),
                 "--max-tokens", "3", "--quiet", *extra])
    return code, dst


def no_model(monkeypatch):
    """Make loading a model fail loudly: the error must come before it."""
    from minillm.llm import LLM

    def refuse(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(LLM, "__init__", refuse)


def test_generate_bom_bad_utf8_deep_nesting_and_bad_messages(tmp_path, capsys):
    data = b"\n".join([
        b"\xef\xbb\xbf" + json.dumps({"id": "a", "prompt": "hello"}).encode(),   # BOM: dropped
        b'{"id": "b", "prompt": "caf\xe9"}',          # Latin-1, not UTF-8
        b"[" * 100_000,                               # json raises RecursionError
        json.dumps({"messages": [{"content": "hi"}]}).encode(),   # no role
        json.dumps({"id": "e", "prompt_token_ids": [5, 6, 7]}).encode(),
    ]) + b"\n"
    code, dst = generate(tmp_path, data)
    assert code == 1
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", 2, 3, 4, "e"]
    assert [o["id"] for o in out if "error" not in o] == ["a", "e"]
    errors = {o["id"]: o["error"] for o in out if "error" in o}
    assert errors[2].startswith("line 2: not valid UTF-8")
    assert errors[3] == "line 3: invalid JSON (nested too deeply)"
    assert errors[4].startswith("line 4: messages[0] must be a dict with string 'role'")
    # (the last line: a CPU without native bf16 says first that --dtype auto chose float32)
    assert capsys.readouterr().err.splitlines()[-1].startswith("2/5 ok")


def test_generate_missing_prompts_fails_before_loading(tmp_path, capsys, monkeypatch):
    from minillm.__main__ import main

    no_model(monkeypatch)
    code = main(["generate", "--model", "tiny-llama", "--prompts", str(tmp_path / "nope.jsonl"),
                 "--out", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: cannot read --prompts ") and "No such file or directory" in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("flags,words", [
    (("--max-num-seqs", "0"), "error: max_num_seqs must be an integer >= 1, got 0"),
    (("--kv-cache-bytes", "0"), "error: kv_cache_bytes must be an integer >= 1, got 0"),
    (("--block-size", "-4"), "error: block_size must be an integer >= 1, got -4"),
])
def test_generate_bad_engine_option_names_it(tmp_path, capsys, flags, words):
    code, dst = generate(tmp_path, b'{"prompt": "hi"}\n', *flags)
    err = capsys.readouterr().err
    assert code == 2 and run_lines(err) == [words]
    assert not dst.exists()


@pytest.mark.parametrize("case", ["directory", "missing-dir", "no-permission"])
def test_generate_unwritable_out_fails_before_loading(tmp_path, capsys, monkeypatch, case):
    if case == "no-permission" and os.geteuid() == 0:
        pytest.skip("root may write anywhere")
    out = {"directory": tmp_path, "missing-dir": tmp_path / "no" / "out.jsonl",
           "no-permission": tmp_path / "ro" / "out.jsonl"}[case]
    if case == "no-permission":
        out.parent.mkdir()
        out.parent.chmod(0o500)
    no_model(monkeypatch)
    code, _ = generate(tmp_path, b'{"prompt": "hi"}\n', out=out)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: cannot write --out {out}: ")
    assert {"directory": "Is a directory", "missing-dir": "No such file or directory",
            "no-permission": "Permission denied"}[case] in err
    assert not [p for p in tmp_path.rglob("*") if p.name != "in.jsonl"
                and (case != "no-permission" or p != out.parent)]   # no out, no temp file


def test_out_is_never_half_written(tmp_path, monkeypatch):
    from minillm.jsonl import write_rows
    from minillm.llm import LLM

    dst = tmp_path / "out.jsonl"
    dst.write_text("old\n")

    def rows():   # fails while writing
        yield {"id": 1}
        raise RuntimeError("disk on fire")
    with pytest.raises(RuntimeError):
        write_rows(str(dst), rows())
    assert dst.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]

    run = LLM.run   # a bug inside the run: the finished line is kept, the other names the bug

    def failing_run(self, requests, on_output=None, **kw):
        def on_out(out):
            on_output(out)
            raise RuntimeError("bug in a callback")
        return run(self, requests, on_output=on_out, **kw)
    monkeypatch.setattr(LLM, "run", failing_run)
    code, _ = generate(tmp_path, b'{"prompt": "hi"}\n{"prompt": "ho"}\n', "--max-num-seqs", "1",
                       out=dst)
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert code == 1 and "text" in out[0]
    assert out[1] == {"id": 2, "error": "line 2: not finished: the run stopped (RuntimeError: "
                                        "bug in a callback)"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]

    monkeypatch.setattr(LLM, "run", run)   # and when all goes well: a normal file, replaced
    code, _ = generate(tmp_path, b'{"prompt": "hi"}\n', out=dst)
    assert code == 0 and "text" in json.loads(dst.read_text())
    assert dst.stat().st_mode & 0o777 == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_generate_interrupt_keeps_finished_lines(tmp_path, capsys, monkeypatch):
    from minillm.llm import LLM

    run = LLM.run

    def interrupted_run(self, requests, on_output=None, **kw):   # Ctrl-C after two outputs
        seen = []

        def on_out(out):
            on_output(out)
            seen.append(out)
            if len(seen) == 2:
                raise KeyboardInterrupt
        return run(self, requests, on_output=on_out, **kw)
    monkeypatch.setattr(LLM, "run", interrupted_run)
    lines = [json.dumps({"id": i, "prompt_token_ids": [5, 6], "max_tokens": 5, "ignore_eos": True})
             for i in range(5)] + ["{bad"]
    code, dst = generate(tmp_path, "\n".join(lines).encode(), "--max-num-seqs", "1")
    assert code == 130
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == [0, 1, 2, 3, 4, 6]
    assert [len(o["token_ids"]) for o in out[:2]] == [5, 5]
    assert [o["error"] for o in out[2:5]] == [f"line {i}: interrupted before it finished"
                                              for i in (3, 4, 5)]
    assert "invalid JSON" in out[5]["error"]
    err = run_lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("interrupted: 2/6 ok, 3 unfinished"), err


# (signal, exit status, the word on stderr and in unfinished lines): by default SIGTERM and SIGHUP
# kill generate at once, writing no --out at all
SIGNALS = [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)"),
           (signal.SIGHUP, 129, "terminated (SIGHUP)")]


@pytest.mark.slow      # a real subprocess per signal
@pytest.mark.parametrize("signum,status,word", SIGNALS, ids=lambda v: str(v))
def test_generate_signal_for_real(tmp_path, signum, status, word):
    """Ctrl-C, SIGTERM or SIGHUP to a running ``generate``: its exit status, every line answered
    (finished ones kept, the others marked), no traceback."""
    n, max_tokens = 100, 150
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": "go", "max_tokens": max_tokens,
                                       "ignore_eos": True}) + "\n" for i in range(n)))
    proc = subprocess.Popen(   # SIGINT back to its default: the test may run in the background
        [sys.executable, "-m", "minillm", "generate", "--model", "tiny-llama", "--prompts",
         str(src), "--out", str(dst), "--max-num-seqs", "1"], cwd=ROOT, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")),
                              daemon=True)
    reader.start()
    try:   # the progress bar shows the first finished line (or give up waiting and interrupt)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None \
                and not re.search(rf"\b[1-9]\d*/{n}\b", "".join(err)):
            time.sleep(0.05)
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    reader.join(timeout=10)
    err = "".join(err)
    assert code == status, err[-2000:]
    assert "Traceback" not in err and f"{word}: " in err
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["id"] for o in out] == list(range(n))
    done = [o for o in out if "error" not in o]
    assert all(len(o["token_ids"]) == max_tokens for o in done)
    assert all(o["error"] == f"line {o['id'] + 1}: {word} before it finished"
               for o in out if "error" in o)
    assert len(done) < n   # 15,000 decode steps, one request at a time, take a while


# Sends the process SIGINT (or another signal) the moment an import of ``torch`` starts: the
# signal lands while the CLI is still loading, deterministically (no race with a timer).
SIGNAL_DURING_IMPORT = """
import os, runpy, signal, sys
SIGNUM = int(sys.argv[1])
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), SIGNUM)
        return None
sys.argv = ["minillm", "generate", "--model", "tiny-llama", "--prompts", sys.argv[2],
            "--out", sys.argv[3]]
sys.meta_path.insert(0, Hook())
runpy.run_module("minillm", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("signum,status,word", SIGNALS, ids=lambda v: str(v))
def test_generate_signal_while_importing(tmp_path, signum, status, word):
    """A signal while torch is still importing (the first second of the CLI) is one line on
    stderr and its exit status, not a traceback nor a death by the signal (-2 for Ctrl-C)."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    proc = subprocess.run([sys.executable, "-c", SIGNAL_DURING_IMPORT, str(int(signum)), str(src),
                           str(tmp_path / "out.jsonl")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                        signal.SIG_DFL))
    assert proc.returncode == status, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {word}"
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_importing_minillm_loads_no_torch():
    """``import minillm`` is light (its names load on first use), so ``python -m minillm`` owns
    its signals before torch starts loading; the names still work."""
    code = ("import sys, minillm; assert 'torch' not in sys.modules, 'torch imported'; "
            "import minillm.__main__; assert 'torch' not in sys.modules, 'torch by __main__'; "
            "from minillm import LLM, SamplingParams; print(LLM.__name__, SamplingParams().n)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["LLM", "1"], proc.stderr[-2000:]


def test_generate_ids_that_json_cannot_write(tmp_path, capsys):
    """``{"id": NaN}`` or ``1e999``, echoed into --out, would be NaN / Infinity (not JSON):
    such a line is an error naming its id, under its line number; the others are served."""
    data = b"\n".join([b'{"id": NaN, "prompt": "a"}', b'{"id": 1e999, "prompt": "b"}',
                       b'{"id": -Infinity, "prompt": "c"}', b'{"id": [1], "prompt": "d"}',
                       b'{"id": true, "prompt": "e"}', b'{"id": "ok", "prompt": "f"}',
                       b'{"id": 12345678901234567890, "prompt": "g"}']) + b"\n"
    code, dst = generate(tmp_path, data)
    assert code == 1
    text = dst.read_text()
    out = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in --out"))
           for line in text.splitlines()]
    assert [o["id"] for o in out] == [1, 2, 3, 4, 5, "ok", 12345678901234567890]
    for o, shown in zip(out, ["NaN", "Infinity", "-Infinity", "[1]", "true"]):
        assert o["error"] == f"line {o['id']}: field 'id' must be a string or an integer, " \
                             f"got {shown}"
    assert all("token_ids" in o for o in out[5:])
    assert run_lines(capsys.readouterr().err)[0].startswith("2/7 ok")


# --- generate when the engine fails mid-run: finished lines kept, the others name the cause -----
def step_lines(n: int) -> list[str]:
    """``n`` lines of different lengths: the short ones finish first, the long ones are still
    running when something breaks."""
    return [json.dumps({"id": i, "prompt_token_ids": [5 + i, 6, 7], "ignore_eos": True,
                        "max_tokens": 2 if i % 3 == 0 else 40}) for i in range(n)]


def same_tokens(row: dict) -> tuple:
    return row["id"], row["token_ids"], row["text"], row["finish_reason"]


def test_generate_engine_failure_keeps_finished_lines(tmp_path, capsys, monkeypatch):
    """Any exception escaping the run (here the engine's step after 6 steps): every line is
    answered in order, the finished ones as a healthy run answers them, exit 1, one stderr line."""
    from minillm.core.engine import PagedEngine

    data = ("\n".join(step_lines(9)) + "\n{bad\n").encode()
    torch_attention = ("--attention", "torch")   # (the C++ kernel is not what this is about)
    code, healthy = generate(tmp_path, data, *torch_attention, out=tmp_path / "healthy.jsonl")
    healthy = [json.loads(line) for line in healthy.read_text().splitlines()]
    assert code == 1 and sum("error" in row for row in healthy) == 1   # the bad line only
    capsys.readouterr()
    step, calls = PagedEngine.step, []

    def failing_step(self):
        calls.append(1)
        if len(calls) > 6:
            raise RuntimeError("injected fault")
        return step(self)
    monkeypatch.setattr(PagedEngine, "step", failing_step)
    code, dst = generate(tmp_path, data, *torch_attention)
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert code == 1
    assert [row["id"] for row in out] == [*range(9), 10]
    done = [row for row in out if "error" not in row]
    assert [row["id"] for row in done] == [0, 3, 6]   # max_tokens 2: finished before the fault
    assert [same_tokens(row) for row in done] == [same_tokens(healthy[i]) for i in (0, 3, 6)]
    for row in out[:9]:
        if "error" in row:
            assert row["error"] == (f"line {row['id'] + 1}: not finished: the run stopped "
                                    "(RuntimeError: injected fault)")
    assert "invalid JSON" in out[9]["error"]
    err = run_lines(capsys.readouterr().err)
    assert err == [f"error: RuntimeError: injected fault: 3/10 ok, 6 unfinished -> {dst}"]


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux: /proc/<pid>/task/*/children)."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += kids - found
            found |= kids
    return found


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.slow      # pipeline worker processes
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the worker in /proc")
def test_generate_pipeline_worker_killed_mid_run(tmp_path):
    """`generate --pipeline-parallel 2`, its rank-1 worker SIGKILLed once lines have finished:
    exit 1, no traceback, one line per input in order -- the finished ones as a healthy run
    writes them, the others an error naming the dead worker -- and no process left behind."""
    n = 48
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(step_lines(n)) + "\n")
    common = ["--model", "tiny-llama", "--prompts", str(src), "--max-num-seqs", "4",
              "--attention", "torch"]
    from minillm.__main__ import main
    assert main(["generate", *common, "--out", str(tmp_path / "healthy.jsonl"), "--quiet"]) == 0
    healthy = [json.loads(line) for line in (tmp_path / "healthy.jsonl").read_text().splitlines()]
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "generate", *common, "--out",
                             str(dst), "--pipeline-parallel", "2"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(1), "")),
                              daemon=True)
    reader.start()
    try:   # once the progress bar shows a finished line, SIGKILL the worker (rank 1)
        deadline, workers, children = time.monotonic() + 240, [], set()
        while time.monotonic() < deadline and proc.poll() is None and not workers:
            if re.search(rf"\b[1-9]\d*/{n}\b", "".join(err)):
                children = descendants(proc.pid)
                workers = [p for p in children if "spawn_main" in
                           Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
            time.sleep(0.05)
        assert len(workers) == 1, "".join(err)[-2000:]
        os.kill(workers[0], signal.SIGKILL)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    reader.join(timeout=10)
    err = "".join(err)
    cause = (rf"WorkerError: pipeline worker rank 1 \(pid {workers[0]}\) exited with code -9 "
             r"\(killed by SIGKILL\)")
    assert code == 1, err[-2000:]
    assert "Traceback" not in err
    assert re.search(rf"(^|[\r\n])error: {cause}.*: \d+/{n} ok, \d+ unfinished -> ", err), err
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [row["id"] for row in out] == list(range(n))
    done = [row for row in out if "error" not in row]
    assert 0 < len(done) < n
    assert [same_tokens(row) for row in done] == [same_tokens(healthy[r["id"]]) for r in done]
    for row in out:
        if "error" in row:
            assert re.fullmatch(rf"line {row['id'] + 1}: not finished: the run stopped "
                                rf"\({cause}.*\)", row["error"]), row["error"]
    left = children | descendants(proc.pid)
    for _ in range(100):   # (multiprocessing's resource tracker exits once it sees ours did)
        if all(gone(p) for p in left):
            break
        time.sleep(0.1)
    assert all(gone(p) for p in left), "a child process was left behind"


# --- serve says which dtype it computes in; a TPOT target no step meets is refused ------------
@pytest.mark.parametrize("flags,native,dtype,line", [
    ([], True, "bfloat16", "[minillm] dtype: auto -> bfloat16 (this CPU computes bf16 natively)"),
    ([], False, "float32", "[minillm] dtype: auto -> float32 (this CPU has no native bf16 "
                           "(AMX-BF16 or AVX512-BF16); emulated bf16 is slower than float32)"),
    (["--dtype", "float16"], False, "float16", "[minillm] dtype: float16 (--dtype)"),
])
def test_serve_says_which_dtype_it_chose_in_one_line(monkeypatch, capsys, flags, native, dtype,
                                                     line):
    """One start-up line, before the model loads; the model is loaded in that dtype (so the
    resolver has nothing left to say)."""
    import torch

    from minillm import models
    from minillm.__main__ import main
    from minillm.llm import LLM

    asked = []

    def load(self, model, engine="paged", dtype=None, **options):
        asked.append(dtype)
        raise ValueError("stopped before loading")
    monkeypatch.setattr(models, "default_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(models, "native_bf16", lambda device_type="cpu": native)
    monkeypatch.setattr(LLM, "__init__", load)
    assert main(["serve", "--model", "tiny-llama", "--port", "0", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [line, "error: stopped before loading"]
    assert asked == [dtype]


def test_generate_refuses_a_tpot_target_below_any_step(tmp_path, capsys):
    """1e-300 ms would hold the controller's batch at one token forever, silently."""
    data = json.dumps({"prompt": "hello"}).encode()
    code, dst = generate(tmp_path, data, "--batch-controller", "tpot",
                         "--tpot-target-ms", "1e-300")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not dst.exists()
    assert err[-1] == "error: tpot_target_ms must be >= 0.1 ms (no step is faster), got 1e-300"


def test_every_subcommand_s_help_prints_every_option():
    """``--help`` formats each option's help (argparse reads a bare % in it as a format: an
    option's help saying '~10%' once broke ``serve --help`` with a ValueError)."""
    import argparse

    from minillm.__main__ import build_parser
    from minillm.engines import all_options
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == {"generate", "bench", "serve"}
    texts = {name: sub.format_help() for name, sub in subs.choices.items()}
    for opt in all_options().values():
        for name in ("generate", "serve"):
            assert opt.flags[0] in texts[name], f"{name} --help lacks {opt.flags[0]}"
