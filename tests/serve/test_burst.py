"""``bench --serve ... --burst K:RATE``: a rate step in the load generator (rung 12's batch
controller is measured under it, docs/rungs/12_realtime.md)."""
from __future__ import annotations

import random
import statistics

import pytest

from minillm.__main__ import main
from minillm.bench.loadgen import parse_burst
from minillm.workload import arrival_offsets


def test_after_k_requests_arrivals_come_at_the_burst_rate():
    k, n = 1000, 3000
    t = arrival_offsets(n, random.Random(0), 2.0, burst=(k, 20.0))
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    # k - 1 gaps at 2/s, then 20/s: means of 0.5 s and 0.05 s (3,000 seeded draws)
    assert statistics.mean(gaps[:k - 1]) == pytest.approx(0.5, rel=0.1)
    assert statistics.mean(gaps[k - 1:]) == pytest.approx(0.05, rel=0.1)
    assert arrival_offsets(50, random.Random(3), 2.0) == \
        arrival_offsets(50, random.Random(3), 2.0, burst=(50, 9.0))[:50]   # k = n: no step


@pytest.mark.parametrize("text,rate,match", [
    ("24", 2.0, "K:RATE"), ("a:3", 2.0, "K:RATE"), ("0:3", 2.0, "K >= 1"),
    ("4:0", 2.0, "RATE > 0"), ("4:inf", 2.0, "RATE > 0"), ("4:3", None, "finite --rate"),
    ("4:3", float("inf"), "finite --rate")])     # all at t=0: there is no rate to step from
def test_bad_bursts_are_errors_naming_the_flag(text, rate, match):
    with pytest.raises(ValueError, match="--burst") as e:
        parse_burst(text, rate)
    assert match in str(e.value)


def test_burst_without_serve_is_refused(capsys):
    assert main(["bench", "--burst", "4:3"]) == 2
    assert "--burst only apply with --serve" in capsys.readouterr().err
