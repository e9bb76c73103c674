"""``bench --serve NAMES --rounds N``: each server driven N times with the same requests, its row
the median of each number (issue 58's served rows, median of 3). ``offline`` (the engine in this
process, the same command path) stands in for a started server here."""
from __future__ import annotations

import json
import statistics

import pytest

from minillm.__main__ import main
from minillm.bench import compare
from minillm.bench.loadgen import median_of

ARGS = ["bench", "--serve", "offline", "--model", "tiny-llama", "--rate", "50", "--requests", "4",
        "--max-tokens", "4", "--ignore-eos"]


def test_each_number_is_the_median_of_the_rounds(tmp_path, capsys):
    out = tmp_path / "rounds.json"
    assert main([*ARGS, "--rounds", "3", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["servers"]["offline"]
    assert len(row["rounds"]) == 3 and row["completed"] == 4
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "output_throughput", "duration"):
        assert row[key] == statistics.median(r[key] for r in row["rounds"]), key
    text = capsys.readouterr().out
    assert "offline, round 3 of 3" in text and "each row: the median of 3 rounds" in text
    ttft = sorted(r["median_ttft_ms"] for r in row["rounds"])
    spread = next(line for line in text.splitlines() if line.startswith("TTFT P50, rounds"))
    assert spread.split()[-1] == f"{ttft[0]:.0f}-{ttft[-1]:.0f}", spread


def test_the_spread_of_the_rounds_is_shown_beside_their_median():
    """A server of one round shows no range, and a NaN round (its requests all failed) is left
    out of the range rather than printed."""
    base = {"completed": 4, "failed": 0, "output_throughput": 10.0, "request_throughput": 1.0,
            "median_ttft_ms": 120.0, "p99_ttft_ms": 5.0, "median_tpot_ms": 40.0,
            "p99_tpot_ms": 50.0, "median_itl_ms": 38.0, "median_e2el_ms": 900.0,
            "preemptions": 0}
    several = {**base, "rounds": [dict(base, median_ttft_ms=v, median_tpot_ms=t) for v, t in
                                  ((120.0, 40.0), (449.4, 35.2), (float("nan"), 52.0))]}
    lines = compare.side_by_side({"a": several, "b": base}).splitlines()
    ttft = next(line for line in lines if line.startswith("TTFT P50, rounds min-max"))
    tpot = next(line for line in lines if line.startswith("TPOT P50, rounds min-max"))
    assert ttft.split()[-2:] == ["120-449", "-"] and tpot.split()[-2:] == ["35-52", "-"]
    assert not any("rounds min-max" in line for line in
                   compare.side_by_side({"a": base, "b": base}).splitlines())


def test_a_round_that_failed_requests_shows_in_the_row():
    ok = {"completed": 4, "failed": 0, "output_throughput": 10.0, "p99_ttft_ms": 5.0,
          "errors": []}
    bad = {"completed": 3, "failed": 1, "output_throughput": 12.0, "p99_ttft_ms": 9.0,
           "errors": ["HTTP 500"]}
    row = median_of([ok, bad, dict(ok, p99_ttft_ms=7.0)])
    assert (row["completed"], row["failed"], row["errors"]) == (3, 1, ["HTTP 500"])
    assert row["p99_ttft_ms"] == 7.0 and row["output_throughput"] == 10.0
    assert median_of([ok]) is ok


@pytest.mark.parametrize("extra, says", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--rounds", "-2", "--requests", "0"],
     "--requests must be >= 1, got 0; --rounds must be >= 1, got -2"),
])
def test_a_count_below_one_is_refused(extra, says, capsys):
    assert main([*ARGS, *extra]) == 2
    assert says in capsys.readouterr().out


def test_rounds_against_a_url_are_refused_and_offline_counts_checked(capsys):
    assert main(["bench", "--serve", "http://127.0.0.1:9", "--rounds", "2"]) == 2
    assert "--rounds drives servers this command starts" in capsys.readouterr().out
    # without --serve, --rounds alternates the offline table's runs (test_offline_rounds.py)
    assert main(["bench", "--rounds", "0"]) == 2
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().out


def test_random_prompts_fit_the_tiny_model_s_vocabulary(tmp_path):
    """``--input-len`` draws token ids inside the model's vocabulary: SmolLM2's range would be
    refused by the tiny model (512 ids), every request failing."""
    out = tmp_path / "tiny.json"
    assert main([*ARGS, "--input-len", "16", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["servers"]["offline"]
    assert (row["completed"], row["failed"]) == (4, 0) and row["total_input_tokens"] == 4 * 16


def test_a_round_where_every_request_failed_ends_the_rounds(monkeypatch, tmp_path, capsys):
    """The same requests would fail alike in the next rounds: one line says so, the row shows
    the one round, and the command fails."""
    from minillm.bench import client
    monkeypatch.setattr(client, "random_ids", lambda model: client.RANDOM_IDS)   # past 512
    out = tmp_path / "failed.json"
    assert main([*ARGS, "--input-len", "16", "--rounds", "3", "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "every request of round 1 failed; the other rounds are not run" in text
    assert "round 2 of 3" not in text
    row = json.loads(out.read_text())["servers"]["offline"]
    assert row["completed"] == 0 and row["failed"] == 4
