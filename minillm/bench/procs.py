"""A process group started for a benchmark, stopped whole: a server (compare.py) or vLLM's offline
worker (vllm_paced.PacedVllm) runs an engine process beside its own, which must not outlive it."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``: from /proc where there is one,
    else whether the group answers a signal at all."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue                     # the process ended while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the server's whole process group (vLLM runs an engine process beside its
    front-end), SIGKILL to whatever is left after ``grace_s``: nothing stays running."""
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        while time.monotonic() < deadline:
            proc.poll()                  # reap the leader
            if not group_members(proc.pid):
                proc.wait(5)             # dead, perhaps since the poll: reaped before returning
                return
            time.sleep(0.1)
        deadline = time.monotonic() + 10.0
    proc.wait(5)
