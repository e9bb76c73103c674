"""The command line: generate from JSONL (bad lines get error lines), and a tiny bench run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
