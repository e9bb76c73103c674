"""Messages between ranks, on torch.distributed point-to-point (rungs 7, 10, 11; notebook 07).

Two kinds of traffic, on two tags so that neither can be mistaken for the other:

* ``TAG_DATA``: tensors whose shape the receiver already knows — hidden states from stage r to
  stage r + 1, logits from the last stage back to rank 0;
* ``TAG_META``: Python objects (the step's metadata, control messages), pickled into a byte
  tensor and sent as two messages, its length then its bytes.

Between one pair of ranks, messages on one tag arrive in the order they were sent: that FIFO
order is all the pipeline's bookkeeping relies on. Every wait has a timeout, and a peer that
died closes its sockets, so a dead peer becomes a ``WorkerError`` on the ranks that talk to
it — never a hang. Gloo carries CPU tensors, NCCL CUDA tensors (one GPU per rank).
"""
from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .timeline import Timeline

TAG_DATA, TAG_META = 0, 1
# How long a worker waits for rank 0's next message. An idle engine (a server between requests,
# a notebook between cells) must not lose its workers; a rank 0 that *dies* closes its sockets,
# which ends this wait at once, so only a live but silent rank 0 is waited for this long.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
# Forming the group waits for every rank to start (a spawned process imports torch: slow on a
# busy machine), so it gets its own bound; waits between running ranks get ``timeout_s``.
CONNECT_TIMEOUT_S = 300.0


class WorkerError(RuntimeError):
    """A pipeline rank died, timed out or broke the protocol; the engine cannot continue.
    ``peer``: the rank this one was waiting for when it gave up (None: not known), which lets
    the launcher tell a rank that stopped answering from the ranks that waited for it."""

    def __init__(self, *args, peer: int | None = None):
        super().__init__(*args)
        self.peer = peer


@contextmanager
def deferred_interrupt():
    """Hold Ctrl-C until the block ends. Sending a micro-batch to every rank, or receiving its
    logits and forgetting it, must happen whole: interrupted halfway, rank 0's books and the
    messages on the wire would disagree from then on. (Only the main thread gets signals.)
    SIGTERM and SIGHUP are held too when Python code handles them (``generate`` turns them into a
    KeyboardInterrupt, ``minillm/__main__.py``); the first signal held is delivered at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    held = [signal.SIGINT] + [s for s in DEFERRABLE if callable(signal.getsignal(s))]
    previous = {s: signal.signal(s, lambda *args: caught.append(args)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            handler = previous[caught[0][0]]
            if callable(handler):
                handler(*caught[0])        # Python's default handler raises KeyboardInterrupt
            elif handler != signal.SIG_IGN:
                raise KeyboardInterrupt


# Signals besides SIGINT that deferred_interrupt holds when Python code handles them
DEFERRABLE = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


@dataclass
class Comm:
    """One rank's end of the pipeline's process group."""

    pg: object                    # a torch.distributed ProcessGroup (gloo or NCCL)
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float = 60.0
    timeline: Timeline = field(default_factory=lambda: Timeline(0))
    pending: list = field(default_factory=list)   # (work, tensor kept alive until sent, dst)
    store: object = None          # the group's key-value store (rung 10 forms subgroups on it)

    # --- tensors ------------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = TAG_DATA) -> None:
        """Start sending; the tensor is kept alive until ``flush`` sees the send complete."""
        tensor = tensor.contiguous()
        self.pending.append((self._call(lambda: self.pg.send([tensor], dst, tag), dst), tensor,
                             dst))

    def recv(self, shape: tuple, dtype: torch.dtype, src: int, tag: int = TAG_DATA,
             what: str | None = "recv", microbatch: int = -1,
             timeout_s: float | None = None) -> torch.Tensor:
        """Receive a tensor of a known shape; the wait is recorded as ``what`` (None: not)."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        with self.timeline.span(what, microbatch) if what else nullcontext():
            work = self._call(lambda: self.pg.recv([out], src, tag), src)
            self.wait(work, src, timeout_s)
        return out

    def prune(self) -> None:
        """Forget the sends that have completed (without waiting for the others)."""
        self.pending = [sent for sent in self.pending if not sent[0].is_completed()]

    def flush(self, microbatch: int = -1) -> None:
        """Wait for every send started so far (they finish in the background meanwhile)."""
        if not self.pending:
            return
        with self.timeline.span("send", microbatch):
            for work, _, dst in self.pending:
                self.wait(work, dst)
        self.pending.clear()

    def wait(self, work, peer: int | None, timeout_s: float | None = None) -> None:
        try:
            work.wait(timedelta(seconds=timeout_s or self.timeout_s))
        except Exception as e:   # gloo: the peer closed its socket, or the timeout passed
            who = f"rank {peer}" if peer is not None else "a peer"
            raise WorkerError(f"rank {self.rank}: lost {who} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else e!r})",
                              peer=peer) from None

    def _call(self, start, peer: int):
        try:
            return start()
        except Exception as e:
            raise WorkerError(f"rank {self.rank}: cannot reach rank {peer} ({e})",
                              peer=peer) from None

    # --- objects ------------------------------------------------------------------------------
    def send_object(self, obj, dst: int) -> None:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.isend(torch.tensor([data.numel()], dtype=torch.int64, device=self.device), dst, TAG_META)
        self.isend(data.to(self.device), dst, TAG_META)

    def recv_object(self, src: int, what: str | None = "recv", microbatch: int = -1,
                    timeout_s: float | None = None):
        """``timeout_s`` bounds the wait for the object to *start* arriving (its length)."""
        size = int(self.recv((1,), torch.int64, src, TAG_META, what, microbatch, timeout_s)[0])
        data = self.recv((size,), torch.uint8, src, TAG_META, what, microbatch)
        return pickle.loads(data.cpu().numpy().tobytes())

    def close(self) -> None:
        self.pending.clear()
        try:
            if hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:   # the peers may be gone already; nothing left to tell them
            pass


def new_group(rank: int, world_size: int, host: str, port: int, device: torch.device,
              timeout_s: float, store=None) -> Comm:
    """Join a process group of its own (not torch's global default group, so that one process can
    hold several engines, and tests can start and stop them): gloo on CPU, NCCL on CUDA.
    Rank 0 passes the ``TCPStore`` it created (it hosts it); the others connect to it."""
    timeout = timedelta(seconds=max(timeout_s, CONNECT_TIMEOUT_S))
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
    pg = process_group(dist.PrefixStore("minillm-pipeline", store), rank, world_size, device,
                       timeout)   # its keys apart from torchrun's own
    return Comm(pg, rank, world_size, device, timeout_s, Timeline(rank), store=store)


def process_group(store, rank: int, size: int, device: torch.device, timeout: timedelta):
    """A process group of ``size`` ranks meeting on ``store``: NCCL on CUDA, gloo on CPU."""
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def group_from_env(device: torch.device, timeout_s: float) -> Comm:
    """Under ``torchrun``: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the launcher,
    and its agent already hosts the store at MASTER_PORT, so every rank connects as a client."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = None
    if not agent_store and rank == 0:
        store = dist.TCPStore(host, port, world, True,
                              timeout=timedelta(seconds=max(timeout_s, CONNECT_TIMEOUT_S)),
                              wait_for_workers=False)
    elif not agent_store:
        time.sleep(0.5)   # let rank 0 start listening; the client also retries until the timeout
    return new_group(rank, world, host, port, device, timeout_s, store)
