"""Starting worker processes on one machine, and watching them (rungs 7, 10, 11; notebook 07).

``launch`` spawns ranks 1..N-1 with torch.multiprocessing (the calling process is rank 0), on
127.0.0.1 and a free port, hands each what it needs (shared memory: tensors are not copied) and
forms the process group; each worker then runs the rung's ``run(comm, shared)``. A watchdog turns
any failure into a clear error: if a worker dies, the next wait on rank 0 fails (its socket
closed), ``WorkerGroup.failure`` names the rank and its exit code, and every other worker is
terminated -- nothing hangs, nothing is left behind. A rank that hangs instead (alive, silent)
makes the ranks waiting for it time out; each names the peer it waited for, and the one they
all waited for is blamed, not the first of them to exit.

Under ``torchrun`` (one process per rank, possibly on several machines) there is nothing to
spawn: ``group_from_env`` joins the group, and each rung says what its other ranks run.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .comm import CONNECT_TIMEOUT_S, Comm, WorkerError, group_from_env, new_group

HOST = "127.0.0.1"


# What a worker wrote in ``WorkerGroup.lost`` (beside the rank it lost, 0..world_size-1)
NO_REPORT, UNKNOWN_PEER = -2, -1


@dataclass
class WorkerGroup:
    """Rank 0's handle on the pipeline: its ``Comm`` and the worker processes it spawned (none
    under torchrun, where the launcher owns the processes)."""

    comm: Comm
    processes: dict[int, object] = field(default_factory=dict)   # rank -> multiprocessing.Process
    store: object = None          # the TCPStore rank 0 hosts: it must live as long as the group
    closed: bool = False
    role: str = "pipeline"        # what the workers are, in messages (rung 11: "prefill")
    # Shared memory, one int per rank: the peer a worker was waiting for when it gave up
    # (NO_REPORT until then). A worker writes it before it exits, so it is visible by the time
    # the exit is; a queue's data could still be in flight.
    lost: object = None

    def reports(self) -> dict[int, int | None]:
        """rank -> the peer it gave up waiting for (None: one it could not name), for each
        worker that reported losing one."""
        if self.lost is None:
            return {}
        return {rank: (None if peer == UNKNOWN_PEER else peer)
                for rank, peer in enumerate(self.lost[:]) if peer != NO_REPORT}

    def exited(self, rank: int) -> str:
        p, reported = self.processes[rank], self.reports()
        why = "" if rank not in reported else " after losing " + (
            "a peer" if reported[rank] is None else f"rank {reported[rank]}")
        return f"{self.role} worker rank {rank} (pid {p.pid}) exited with code " \
               f"{p.exitcode}{signal_name(p.exitcode)}{why}"

    def dead_worker(self) -> str | None:
        """A worker that ended on its own (killed, crashed, exited): not one that exited because
        it lost a peer (that one only reports the cause)."""
        reported = self.reports()
        for rank, p in self.processes.items():
            if p.exitcode is not None and rank not in reported and \
                    not (p.exitcode == 0 and self.closed):
                return self.exited(rank)
        return None

    def silent_rank(self, error: Exception) -> str | None:
        """A live worker that others gave up waiting for, and that lost no one itself: it stopped
        answering (hung, stopped). The ranks that waited for it time out and exit; they are
        not the cause."""
        lost = self.reports()
        if getattr(error, "peer", None) is not None:
            lost[self.comm.rank] = error.peer
        for peer in sorted({q for q in lost.values() if q is not None}):
            p = self.processes.get(peer)
            if peer not in lost and p is not None and p.is_alive():
                waiters = sorted(r for r, q in lost.items() if q == peer)
                return f"{self.role} worker rank {peer} (pid {p.pid}) stopped answering: " \
                       f"rank{'s' * (len(waiters) > 1)} {', '.join(map(str, waiters))} " \
                       "gave up waiting for it"
        return None

    def failure(self, error: Exception, grace_s: float = 5.0) -> WorkerError:
        """The error to raise after a failed wait, naming the cause, then every worker is stopped.
        A worker that died is the cause (waiting up to ``grace_s`` for its exit to be visible);
        failing that, a live rank the others gave up waiting for; failing that, the first
        worker that exited."""
        deadline = time.monotonic() + grace_s
        why = self.dead_worker()
        while why is None and self.processes and time.monotonic() < deadline:
            time.sleep(0.05)
            why = self.dead_worker()
        why = why or self.silent_rank(error) or next(
            (self.exited(r) for r, p in self.processes.items() if p.exitcode is not None), None)
        self.terminate()
        return WorkerError(f"{why or f'the {self.role} group failed'}; all ranks stopped "
                           f"({error})")

    def terminate(self) -> None:
        self.closed = True
        for p in self.processes.values():
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(OSError):   # a stopped rank acts on SIGTERM once
                    os.kill(p.pid, signal.SIGCONT)   # continued
        for p in self.processes.values():
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)
        self.comm.close()

    def close(self) -> None:
        """Stop the workers politely ("stop"), then make sure they are gone."""
        if self.closed:
            return
        self.closed = True
        try:
            for rank in range(1, self.comm.world_size):
                self.comm.send_object("stop", rank)
            self.comm.flush()
        except WorkerError:
            pass                       # a worker is gone already: terminate() below handles it
        for p in self.processes.values():
            p.join(5)
        self.terminate()


def signal_name(exitcode: int) -> str:
    """The suffix ' (killed by SIGKILL)' for a process a signal ended (exit code -9 here)."""
    try:
        return f" (killed by {signal.Signals(-exitcode).name})" if exitcode < 0 else ""
    except ValueError:
        return ""


def launch(shared, world_size: int, timeout_s: float, worker_threads: int, run,
           role: str) -> WorkerGroup:
    """Spawn ranks 1..world_size-1 on this machine (CPU, gloo) and join the group as rank 0.
    Each worker then runs ``run(comm, shared)``: the pipeline's ``run_worker`` with the
    ``PagedLlama``, rung 10's tensor-parallel worker, rung 11's prefill worker with the
    ``LoadedModel``; ``role`` names them in errors and process names. Tensors in
    ``shared`` travel as shared memory (nothing is copied)."""
    start_s = max(timeout_s, CONNECT_TIMEOUT_S)   # importing torch in a worker can be slow
    store = dist.TCPStore(HOST, 0, world_size, True, timeout=timedelta(seconds=start_s),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    lost = ctx.Array("i", [NO_REPORT] * world_size, lock=False)
    procs = {}
    for rank in range(1, world_size):
        procs[rank] = ctx.Process(target=worker_main, name=f"minillm-{role}-rank{rank}",
                                  args=(rank, world_size, store.port, shared, timeout_s,
                                        worker_threads, ready, run, lost), daemon=True)
        procs[rank].start()
    group = WorkerGroup(Comm(None, 0, world_size, torch.device("cpu")), procs, store, role=role,
                        lost=lost)
    # Wait for every worker to have started (imports done) before forming the group: a worker
    # that dies on the way is reported now rather than after the group's whole timeout.
    started, deadline = set(), time.monotonic() + start_s
    while len(started) < world_size - 1:
        try:
            started.add(ready.get(timeout=0.1))
        except queue.Empty:
            why = group.dead_worker()
            if why or time.monotonic() > deadline:
                group.terminate()
                raise WorkerError(why or f"{role} workers did not start in {start_s} s")
    try:
        group.comm = new_group(0, world_size, HOST, store.port, torch.device("cpu"), timeout_s,
                               store)
    except Exception as e:
        raise group.failure(e) from None
    return group


def worker_main(rank: int, world_size: int, port: int, shared, timeout_s: float,
                threads: int, ready, run, lost) -> None:
    """A spawned worker: join the group, then serve until "stop" (exit 0) or a failure (exit 1,
    after writing in ``lost`` which peer it gave up waiting for)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is rank 0's to handle, not ours
    exit_with_parent()
    torch.set_num_threads(threads)
    ready.put(rank)
    try:
        comm = new_group(rank, world_size, HOST, port, torch.device("cpu"), timeout_s)
        run(comm, shared)
    except WorkerError as e:
        lost[rank] = UNKNOWN_PEER if e.peer is None else e.peer
        print(f"[minillm worker {rank}] {e}", file=sys.stderr)
        sys.exit(1)


def exit_with_parent(poll_s: float = 0.5) -> None:
    """A spawned worker never outlives rank 0, even one killed outright (SIGKILL runs no clean-up
    and sends no "stop"): once its parent is gone, the worker exits within ``poll_s``."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)
    threading.Thread(target=watch, name="minillm-parent-watch", daemon=True).start()


def under_torchrun() -> bool:
    """torchrun (torch.distributed.elastic) sets these for every process it starts."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def torchrun_device(model_device: torch.device | None = None) -> torch.device:
    """One GPU per process on CUDA (LOCAL_RANK picks it), the CPU otherwise."""
    if torch.cuda.is_available() and (model_device is None or model_device.type == "cuda"):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def torchrun_group(timeout_s: float, device: torch.device) -> WorkerGroup:
    return WorkerGroup(group_from_env(device, timeout_s))
