"""OpenMP's spin bound (minillm/openmp.py): set by ``import minillm`` before torch loads, never over
a user's choice, and kept out of the peers' environments."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minillm.openmp import BOUNDED_SPIN, MARK, SPIN_VARIABLE, bound_openmp_spin, peer_environ


def fresh_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in (SPIN_VARIABLE, MARK, "OMP_WAIT_POLICY")}
    return {**env, **extra}


def spin_seen_by_a_fresh_process(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", code + "\nprint(os.environ.get('GOMP_SPINCOUNT'))"],
                         env=env, capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_import_minillm_bounds_the_spin_before_torch_loads():
    assert spin_seen_by_a_fresh_process("import os, minillm", fresh_env()) == BOUNDED_SPIN
    # and what the process starts inherits it (servers, ranks, graders)
    code = ("import os, subprocess, sys, minillm\n"
            "print(subprocess.run([sys.executable, '-c', 'import os; "
            "print(os.environ.get(\"GOMP_SPINCOUNT\"))'], capture_output=True, text=True)"
            ".stdout.strip())\nos.environ['GOMP_SPINCOUNT'] = 'unused'")
    out = subprocess.run([sys.executable, "-c", code], env=fresh_env(), capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    assert out[0] == BOUNDED_SPIN


@pytest.mark.parametrize("extra", [{"GOMP_SPINCOUNT": "123"}, {"OMP_WAIT_POLICY": "PASSIVE"},
                                   {"OMP_WAIT_POLICY": "active"}])
def test_a_users_wait_policy_wins(extra):
    seen = spin_seen_by_a_fresh_process("import os, minillm", fresh_env(**extra))
    assert seen == extra.get("GOMP_SPINCOUNT", "None")


def test_nothing_is_set_once_torch_is_loaded():
    # libgomp has read its variables by then: setting one would only mislead the processes below
    assert spin_seen_by_a_fresh_process("import os, torch, minillm", fresh_env()) == "None"
    assert "torch" in sys.modules and bound_openmp_spin({}) is False     # as in this process


def test_peers_run_with_their_own_defaults():
    ours = {"A": "1", SPIN_VARIABLE: BOUNDED_SPIN, MARK: "1"}
    assert peer_environ(ours) == {"A": "1"}
    users = {SPIN_VARIABLE: "50"}
    assert peer_environ(dict(users)) == users


def test_the_vllm_workers_environment_lacks_our_bound(monkeypatch):
    from minillm.bench import vllm_peer
    monkeypatch.setenv(SPIN_VARIABLE, BOUNDED_SPIN)
    monkeypatch.setenv(MARK, "1")
    env = vllm_peer.worker_env(2)
    assert SPIN_VARIABLE not in env and MARK not in env
    monkeypatch.delenv(MARK)
    assert vllm_peer.worker_env(2)[SPIN_VARIABLE] == BOUNDED_SPIN     # a user's own stays
