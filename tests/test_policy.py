"""Scheduling policies (core/policy.py, notebook 08). The behaviour — urgent preemption for a full
batch and for a full pool, the threshold, the starvation bound under ``score`` on a stream that
starves ``priority``, no ping-pong evictions, tokens equal FCFS's — is exercise 08's grader, run
here on the package's own code (its tests are imported below); this module adds the config and
HTTP."""
from __future__ import annotations

import pytest

from minillm import LLM
from minillm.core.config import SchedulerConfig
from minillm.core.policy import FCFS, Priority, Score, get_policy, make_policy
from minillm.lab.graders.test_08 import *  # noqa: F401,F403 - the behaviour tests (exercise 08)


def test_config_fields_are_checked_and_reach_the_policy():
    cfg = SchedulerConfig(policy="score", score_wait_weight=2, score_remaining_weight=0.5,
                          score_priority_weight=7, score_margin=1)
    assert make_policy(cfg) == Score(2.0, 0.5, 7.0, 1.0)
    assert make_policy(SchedulerConfig(policy="priority", priority_preemption_threshold=3)) \
        == Priority(3)
    assert make_policy(SchedulerConfig()) == FCFS()
    for field, value, why in [("score_wait_weight", -1.0, ">= 0"),
                              ("score_margin", float("nan"), "finite"),
                              ("score_priority_weight", "high", "must be a number"),
                              ("priority_preemption_threshold", -1, ">= 0")]:
        with pytest.raises(ValueError, match=f"{field}.*{why}|{field} must"):
            SchedulerConfig(**{field: value})
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        get_policy("lifo")
    with pytest.raises(ValueError, match="no starvation bound"):
        Score(wait_weight=0).overtake_horizon(None, 0)


def test_priority_over_http_labels_metrics_and_reaches_the_scheduler(tiny):
    """``priority`` on both endpoints (vLLM's extra): it reaches the request, /metrics has TTFT and
    TPOT histograms per class, a 17th class shares "other", and a bad value is a 400 naming it."""
    import httpx
    from serve_util import running_server

    from minillm.serve.metrics import MAX_CLASSES

    llm = LLM(tiny, engine="paged", num_blocks=96, max_num_seqs=4, policy="priority")
    seen: list[int] = []
    with running_server(llm, max_waiting=64) as (url, app):
        app.state.loop.on_step.append(
            lambda loop, out: seen.extend(r.priority for r in out.finished))
        body = {"model": "tiny-llama", "max_tokens": 3, "temperature": 0}
        for p in [*range(MAX_CLASSES), 99, -5]:
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "hi", "priority": p},
                           timeout=60)
            assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            **body, "messages": [{"role": "user", "content": "hi"}], "priority": 3})
        assert r.status_code == 200, r.text
        for bad in ("high", 1.5, 1 << 40):
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "x", "priority": bad},
                           timeout=60)
            assert r.status_code == 400 and "priority" in r.text, (bad, r.text)
        text = httpx.get(f"{url}/metrics", timeout=30).text
    assert sorted(seen) == sorted([*range(MAX_CLASSES), 99, -5, 3])
    counts = {line.split('priority="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines()
              if line.startswith("minillm:time_to_first_token_by_priority_seconds_count")}
    assert counts == {**{str(p): 1.0 for p in range(MAX_CLASSES) if p != 3}, "3": 2.0,
                      "other": 2.0}
    assert "minillm:time_per_output_token_by_priority_seconds_bucket" in text
