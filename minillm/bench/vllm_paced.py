"""vLLM's offline worker kept between rounds: ``bench --rounds`` (offline_rounds.py) runs the
table's engines in turn, and vLLM's turn is one ``round`` of this worker, its model loaded once.
The worker is vllm_peer's, told when to run by a line protocol on its standard streams (READY /
ROUND, vllm_peer.take_turn)."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path

from .vllm_peer import (READY, ROUND, PeerError, with_env, worker_command, worker_env,
                        write_spec)


class PacedVllm:
    """vLLM's offline engine in its own process, running the workload once each time ``round``
    is called (``bench --rounds``, offline_rounds.py). Between rounds it waits, its model loaded,
    while minillm runs its own; ``finish`` lets it measure its single streams and returns its
    JSON as ``run_vllm`` does. ``command`` replaces the worker's (tests)."""

    def __init__(self, model, requests, max_num_seqs: int, workdir: Path, rounds: int,
                 command: list[str] | None = None):
        spec, self.out = write_spec(model, requests, max_num_seqs, workdir, rounds=rounds,
                                    paced=True)
        self.env, self.log, self.ready = worker_env(), workdir / "vllm_worker.log", False
        # its own process group: vLLM runs its engine in a process of its own, which ``close``
        # stops with it (and a Ctrl-C in the terminal reaches the bench, which then stops both)
        with self.log.open("w") as log:      # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(command or worker_command(spec, self.out), env=self.env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, start_new_session=os.name != "nt")
        # Its lines are read on a thread of their own: a worker killed between rounds leaves its
        # engine process holding the pipe open, so no end of file comes, and waiting for a line
        # must also watch whether the worker is still there (a hostile test hung here).
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _expect(self, marker: str, what: str) -> str:
        while True:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:                  # None: gone, though its pipe is still open
                line = "" if self.proc.poll() is None else None
            if line is None:
                self._died(what)
            if line.startswith(marker):          # vLLM's own log lines pass by
                return line[len(marker):].strip()

    def _died(self, what: str):
        code = self.proc.wait()
        tail = self.log.read_text(errors="replace")[-3000:]
        raise PeerError(f"vLLM's worker exited with code {code} before {what}; the end of "
                           f"its log ({self.log}):\n{tail}")

    def _say(self, word: str) -> None:
        try:
            self.proc.stdin.write(word + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass                                 # gone: _expect says so, with its log

    def wait_ready(self) -> None:
        """Block until vLLM has loaded, compiled and warmed up (or between rounds, is idle)."""
        if not self.ready:
            self._expect(READY, "it was ready")
            self.ready = True

    def round(self) -> float:
        """The workload once more in vLLM: its duration in seconds."""
        self.wait_ready()
        self._say("go")
        self.ready = False
        return float(self._expect(ROUND, "it finished its round"))

    def finish(self) -> dict:
        """No more rounds: the worker measures its single streams and writes its JSON."""
        self.wait_ready()
        self._say("done")
        self.proc.stdin.close()
        if self.proc.wait() != 0:
            self._died("it wrote its results")
        return with_env(json.loads(self.out.read_text()), self.env)

    def close(self) -> None:
        """Stop the worker and every process it started, whatever state they are in."""
        if os.name != "nt":
            from .procs import stop
            stop(self.proc, grace_s=5.0)
        elif self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


__all__ = ["PacedVllm"]
