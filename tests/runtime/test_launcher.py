"""Which rank a failed group blames (dist/launcher.py): a rank that died, or one that stopped
answering -- never a rank that only gave up waiting for it."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from minillm import LLM, SamplingParams
from minillm.dist.comm import WorkerError
from minillm.dist.launcher import NO_REPORT, WorkerGroup
from minillm.lab.reference import random_prompts


class FakeProcess:
    """What ``WorkerGroup`` reads of a multiprocessing.Process: no process behind it."""

    def __init__(self, pid: int, exitcode: int | None = None):
        self.pid, self.exitcode = pid, exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None


def group(exits: dict[int, int | None], lost: dict[int, int], monkeypatch) -> WorkerGroup:
    """Ranks 1..: ``exits`` their exit codes (None: alive), ``lost`` the peers they reported."""
    table = [NO_REPORT] * (max(exits) + 1)
    for rank, peer in lost.items():
        table[rank] = peer
    g = WorkerGroup(SimpleNamespace(rank=0), {r: FakeProcess(1000 + r, code)
                                             for r, code in exits.items()}, role="tensor-parallel",
                    lost=table)
    monkeypatch.setattr(g, "terminate", lambda: None)      # nothing to stop
    return g


def test_the_rank_everyone_waited_for_is_blamed_not_the_first_to_exit(monkeypatch):
    g = group({1: 1, 2: 1, 3: None}, {1: 3, 2: 3}, monkeypatch)
    error = g.failure(WorkerError("rank 0: lost rank 3 (timeout)", peer=3), grace_s=0)
    assert str(error).startswith("tensor-parallel worker rank 3 (pid 1003) stopped answering: "
                                 "ranks 0, 1, 2 gave up waiting for it")


def test_a_rank_that_died_is_blamed_before_the_ranks_that_lost_it(monkeypatch):
    # rank 1 exited first (it lost rank 3), rank 3 was killed: rank 3 is the cause
    g = group({1: 1, 2: None, 3: -9}, {1: 3}, monkeypatch)
    error = g.failure(WorkerError("rank 0: lost rank 3 (closed)", peer=3), grace_s=0)
    assert str(error).startswith("tensor-parallel worker rank 3 (pid 1003) exited with code -9 "
                                 "(killed by SIGKILL)")


def test_a_chain_of_waits_ends_at_the_silent_rank(monkeypatch):
    # a pipeline: rank 0 waited for rank 2, which waited for rank 1, which hangs
    g = group({1: None, 2: 1}, {2: 1}, monkeypatch)
    error = g.failure(WorkerError("rank 0: lost rank 2", peer=2), grace_s=0)
    assert str(error).startswith("tensor-parallel worker rank 1 (pid 1001) stopped answering: "
                                 "rank 2 gave up waiting")


def test_without_a_named_peer_the_exit_says_what_the_worker_lost(monkeypatch):
    g = group({1: 1, 2: None}, {1: -1}, monkeypatch)
    error = g.failure(WorkerError("rank 0: lost a peer"), grace_s=0)
    assert str(error).startswith("tensor-parallel worker rank 1 (pid 1001) exited with code 1 "
                                 "after losing a peer")


@pytest.mark.slow
@pytest.mark.xdist_group("ranks")
def test_a_stopped_rank_of_four_is_named(tiny):
    """Rank 3 of 4 is SIGSTOPped between steps: ranks 0, 1 and 2 time out in the next all-reduce
    and 1 and 2 exit; the error names rank 3. The timeout is generous so that no step of the
    tiny model reaches it before the stop, however busy the machine."""
    llm = LLM(tiny, tensor_parallel_size=4, pipeline_timeout_s=20)
    procs = dict(llm.engine.group.processes)

    def stop_rank_3(snapshot, record):
        if record.step == 3:
            os.kill(procs[3].pid, signal.SIGSTOP)
    reqs = llm.make_requests(random_prompts(4, seed=99),
                             SamplingParams(max_tokens=30, ignore_eos=True))
    try:
        with pytest.raises(WorkerError, match=r"worker rank 3 \(pid \d+\) stopped answering"):
            llm.run(reqs, on_step=stop_rank_3)
        assert not any(p.is_alive() for p in procs.values())
    finally:
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.join(10)
        llm.engine.close()
