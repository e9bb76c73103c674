"""``xdist_group`` marks hold: under ``--dist loadgroup`` (``make test``) the tests of one group
run on one worker. The rank-starting files rely on it (docs/TESTING.md), and so does a module
fixture that must run once (the PyPI resolutions). pytest 9.2 with pytest-xdist 3.8 ignored every
mark without a word; this runs a planted suite on two workers and reads where each test ran."""
from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

PLANTED = '''
import os
import pytest

pytestmark = pytest.mark.xdist_group("{group}")


@pytest.mark.parametrize("i", range(6))
def test_where(i):
    with open({log!r}, "a") as f:
        f.write(f"{group} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
'''


def test_each_group_runs_on_one_worker(tmp_path):
    log = tmp_path / "where.txt"
    for group in ("one", "two"):
        (tmp_path / f"test_{group}.py").write_text(PLANTED.format(group=group, log=str(log)))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup",
                          "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    workers = defaultdict(set)
    for line in log.read_text().splitlines():
        group, worker = line.split()
        workers[group].add(worker)
    assert sum(1 for _ in log.read_text().splitlines()) == 12
    assert all(len(w) == 1 for w in workers.values()), \
        f"a group's tests ran on several workers: {dict(workers)} (pytest and pytest-xdist agree " \
        f"on where a node id lives? requirements.txt pins pytest below 9.2 for this)"
