"""Rung 11's engine: decode here, prefill in another process, KV blocks moved between their pools
(notebook 11).

Rank 0 is rung 3's engine, serving decodes, and it owns every request. A new request's prompt
(all but its last token) goes to the prefill worker (``prefill.py``, its own scheduler, block
manager and pool). Once prefilled there, its blocks wait until this pool has room for them; then
rank 0 *pulls* them: the prefill worker sends the filled blocks as stored (every layer's K and V,
scales too), rank 0 allocates as many blocks (``BlockManager.allocate_loaded``), writes them in
(``KVPool.write_blocks``) and hands the request to its scheduler with the prompt but its last
token computed. Its next step computes that token and samples the first output token: the same
sampler and commit point as rung 3, so the tokens are rung 3's. Then it acknowledges, and the
prefill worker frees its blocks (or keeps them as prefix cache). Landed blocks whose request
waits behind one that cannot fit are given back: it recomputes here (``_idle``). Prompts of at
most ``local_prefill_max_tokens`` tokens skip the prefill worker: prefilled here, as in rung 3.

The two workers run at their own pace: rank 0 sends a command, keeps decoding, and reads the
reply whenever it has arrived (then sends the next command); the prefill worker answers each
command at once and then runs one prefill step. A long prompt's prefill never stalls the decodes
(the point of disaggregation), and the decodes never delay a prompt. The reply and its blocks are
received on a thread of their own while rank 0 decodes: gloo completes a receive only inside its
``wait`` (a poll never sees one arrive), so the thread waits and the step lands what it has.
"""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ...runtime.config import options_of
from ...core.engine import PagedEngine
from ...memory import MemorySnapshot
from ...checks import check_field
from ...request import FinishReason, Request, RequestError
from ...runtime.interface import StepOutput
from ...dist.comm import WorkerError, deferred_interrupt
from ...dist.launcher import WorkerGroup, launch
from .config import DisaggConfig
from .prefill import run_prefill_worker
from .transfer import (Command, Handoff, Reply, end_unadmitted, install_blocks, make_room_for_head,
                       pool_layout, recv_blocks)

MAX_TRANSFERS = 10_000


@dataclass
class Transfer:
    """One request's hand-off, measured on rank 0."""

    num_tokens: int
    num_blocks: int
    nbytes: int
    seconds: float          # the blocks on the wire: from the reply to the last byte here
    waited_s: float         # from the pull (rank 0 asking for them) to the blocks written here
    landed: bool            # False: no room when they arrived, recomputed here instead


class DisaggEngine(PagedEngine):
    name = "disagg"
    supports_parallel = False    # n > 1 and beams: refused (validate says why)
    refuses = frozenset({"prompt_logprobs"})   # prompts are computed on the prefill worker
    has_prefill_pool = True
    configs = PagedEngine.configs + (DisaggConfig,)

    def __init__(self, model, *, group: WorkerGroup | None = None, **options):
        if group is None and model.device.type != "cpu":
            raise ValueError("spawning the prefill worker works on one CPU machine")
        super().__init__(model, **options)           # the decode side: rung 3's engine
        c = self.disagg_config
        self.group = group or launch(model, 2, c.transfer_timeout_s, c.worker_threads,
                                     run=run_prefill_worker, role="prefill")
        self.comm = self.group.comm
        self._finalizer = weakref.finalize(self, self.group.close)
        self.broken: WorkerError | None = None
        try:
            self.comm.send_object(self.prefill_options(), 1)
            kind, value = self.comm.recv_object(1, what=None)
        except WorkerError as e:
            raise self.group.failure(e) from None
        if kind != "ready":
            self.close()
            raise ValueError(f"the prefill worker could not start: {value}")
        self.prefill_blocks = value
        self.layout = pool_layout(self.runner.pool.tensors())
        self.prefilling: dict[str, Request] = {}           # on the prefill worker
        self.ready: dict[str, tuple[Request, int]] = {}    # prefilled there, waiting for room here
        self.pulling: dict[str, tuple[Request, float]] = {}
        self.command = Command()
        self.pending: Future | None = None                 # the reply to the last command
        self.transfers: dict[str, Transfer] = {}
        self.prefill_pool = (value, value)                 # its free and total blocks, last seen
        self._prefill_picture: MemorySnapshot | None = None
        self._want_picture = False
        self._room_made: tuple = ()          # (step, head): ``_idle`` made room for it

    @property
    def threads_in_workers(self) -> int:
        return self.disagg_config.worker_threads

    def prefill_options(self) -> dict:
        """The prefill worker's engine options: this engine's and its scheduling policy (the
        order prompts are computed in; its steps keep the config's batch), its budget and pool
        from ``DisaggConfig``. The layout (block size, KV dtype, backends) must be the same."""
        out = {o.name: getattr(cfg, o.field)
               for cfg in (self.cache_config, self.scheduler_config, self.model_config)
               for o in options_of(type(cfg)).values()}
        out["policy"] = self.scheduler.policy
        c = self.disagg_config
        if c.prefill_kv_cache_bytes is not None:
            out.update(kv_cache_bytes=c.prefill_kv_cache_bytes, num_blocks=None)
        if c.prefill_max_num_batched_tokens is not None:
            out["max_num_batched_tokens"] = c.prefill_max_num_batched_tokens
        return out

    # --- requests ---------------------------------------------------------------------------------
    def prefilled_here(self, req: Request) -> bool:   # (a short prompt: nothing worth moving)
        return req.prompt_len <= max(1, self.disagg_config.local_prefill_max_tokens)

    def validate(self, req: Request) -> None:
        super().validate(req)   # (n > 1 and beams: refused there, supports_parallel is False)
        # the prefill pool only matters to a prompt that goes there (a short one never does)
        if not self.prefilled_here(req) and \
                -(-(req.prompt_len - 1) // self.block_size) > self.prefill_blocks:
            raise RequestError(f"{req.request_id}: its prompt needs more blocks than the prefill "
                               f"worker's pool has ({self.prefill_blocks}); it could never run")

    def add_request(self, req: Request) -> None:
        rid = req.request_id
        if rid in self.groups or rid in self.prefilling or rid in self.ready or rid in self.pulling:
            raise RequestError(f"{rid}: a request with this id is already in flight")
        try:   # checked again (the worker's Request would raise): callers set it after creation
            check_field("priority", req.priority)
        except ValueError as e:
            raise RequestError(f"{rid}: {e}") from None
        if self.prefilled_here(req):
            self.scheduler.add(req)          # computed here: nothing (worth) moving
            return
        self.prefilling[rid] = req
        self.command.new.append((rid, list(req.prompt_token_ids[:-1]), req.priority))

    def has_unfinished(self) -> bool:
        """Until the prefill worker has been told of every landed transfer and abort too: a run
        ends with both pools back to full."""
        return super().has_unfinished() or self.pending is not None or bool(
            self.prefilling or self.ready or self.pulling or self.command.acks or
            self.command.aborts)

    def num_waiting(self) -> int:
        """Requests not yet decoding here: queued, prefilling, prefilled, or in transfer."""
        return super().num_waiting() + len(self.prefilling) + len(self.ready) + len(self.pulling)

    def stages(self) -> dict[str, list[Request]]:
        """Where the requests that are not decoding here are (the dashboard's waiting list)."""
        return {"prefilling": list(self.prefilling.values()), "prefilled": [
            r for r, _ in self.ready.values()], "in transfer": [r for r, _ in self.pulling.values()]}

    def abort(self, request_id: str) -> bool:
        elsewhere = self.prefilling.pop(request_id, None) or \
            (self.ready.pop(request_id, (None,))[0])
        if elsewhere is not None:
            self.command.aborts.append(request_id)
        elif request_id in self.pulling:      # its blocks are on the way: dropped when they land
            elsewhere = self.pulling[request_id][0]
        if elsewhere is None:
            return super().abort(request_id)
        if elsewhere.finished:
            return False
        self.aborted.append(end_unadmitted(elsewhere, FinishReason.ABORT))
        return True

    # --- one step: both workers at once ---------------------------------------------------------
    def _step(self) -> StepOutput:
        """Rank 0's decode step; around it, the exchange with the prefill worker, which runs at
        its own pace: a command goes out when its last reply is in, and a reply is read only once
        it has arrived — the decodes never wait for a prefill (unless they have nothing to do)."""
        if self.broken is not None:
            raise self.broken
        lockstep = self.disagg_config.lockstep   # (one command and its reply per step)
        with deferred_interrupt():    # a reply read <=> its blocks landed and acknowledged
            self._exchange(block=lockstep)
            try:
                out = super()._step()
            finally:
                idle = not self.scheduler.has_unfinished()
                self._exchange(block=lockstep or idle, send=not lockstep)
        return out

    def _exchange(self, block: bool, send: bool = True) -> None:
        """Read the prefill worker's reply if it is in (or wait for it: ``block``), then send the
        next command (``send``) if the worker has anything to do."""
        try:
            if self.pending is not None and (block or self.pending.done()):
                (reply, moved), self.pending = self.pending.result(), None
                self._take_reply(reply, moved)
            if send and self.pending is None and (
                    self.prefilling or self.ready or self.command.new or self.command.aborts or
                    self.command.acks):
                self.command.pulls = self._choose_pulls()
                self.command.snapshot, self._want_picture = self._want_picture, False
                self.comm.send_object(self.command, 1)
                self.command = Command()
                self.pending = self._post_read()
        except WorkerError as e:
            self._break(e)

    def _choose_pulls(self) -> list[str]:
        """Prefilled requests, oldest first, while this pool has the blocks each needs to be
        admitted (its whole prompt, last token included: the paged scheduler's ``can_append``)
        beyond what the requests here need first (``_claimed``), and a seat; nobody overtakes."""
        free = self.block_manager.num_free_blocks - self._claimed()
        seats = self.scheduler.max_num_seqs - len(self.scheduler.running) - \
            len(self.scheduler.waiting)
        pulls = []
        for rid, (req, n) in list(self.ready.items()):
            need = -(-(n + 1) // self.block_size)
            if need > free or seats <= 0:
                break
            free, seats = free - need, seats - 1
            del self.ready[rid]
            self.pulling[rid] = (req, time.perf_counter())
            pulls.append(rid)
        return pulls

    def _claimed(self) -> int:
        """Blocks the requests here need before a pulled one: a running one's next step (at least
        a block: it decodes on), a waiting one's admission (all it has left to compute). A pulled
        request lands behind the waiting queue; blocks landed where the queue cannot admit them
        would only wait there (and be given back: ``_idle``)."""
        blocks = self.block_manager
        return sum(max(1, blocks.blocks_needed(s, s.num_uncomputed))
                   for g in self.scheduler.running for s in g.seqs) + \
            sum(blocks.blocks_needed(s, s.num_uncomputed) for g in self.scheduler.waiting
                for s in g.seqs)

    def _idle(self, out: StepOutput) -> StepOutput:
        """Nothing was scheduled. Rung 3 calls that a bug when nothing runs and requests wait, since
        there a waiting request holds no blocks and the queue's head alone always fits. Here a
        landed request holds its blocks while it waits to be admitted; behind a head that cannot
        fit (preempted, or a prompt recomputed here) they would keep it out for ever, as nobody
        overtakes. So they are given back, lowest-ranked first, until the head fits — those
        requests recompute their prompts here (from the prefix cache, when it is on) — and the
        next step admits the head. The same head still out the step after: a bug, raised."""
        sched = self.scheduler
        if sched.running or not sched.waiting or \
                self._room_made == (self.total_steps - 1, sched.waiting[0]):
            return super()._idle(out)
        make_room_for_head(sched)
        self._room_made = (self.total_steps, sched.waiting[0])
        return out

    def _post_read(self) -> Future:
        """Receive the reply to the command just sent, and the blocks that follow it, on a thread
        of its own (see the module's docstring); the step takes the result once it is done."""
        done: Future = Future()

        def read():
            try:
                reply = self.comm.recv_object(1, what=None)
                moved = []
                for h in reply.sent:
                    t = time.perf_counter()
                    data = recv_blocks(self.comm, 1, h.num_blocks, self.layout)
                    moved.append((data, time.perf_counter() - t))
                done.set_result((reply, moved))
            except Exception as e:     # the step re-raises it (result())
                done.set_exception(e)
            finally:                   # never leave the step waiting on a reader that died
                if not done.done():
                    done.set_exception(WorkerError("the prefill worker's reply reader stopped"))
        threading.Thread(target=read, name="minillm-disagg-reply", daemon=True).start()
        return done

    def _take_reply(self, reply: Reply, moved: list[tuple[list[torch.Tensor], float]]) -> None:
        """The prefill worker's reply: newly prefilled requests, and the pulled blocks (with the
        seconds each hand-off's bytes took to arrive)."""
        self.prefill_pool = (reply.free_blocks, reply.num_blocks)
        if reply.snapshot is not None:
            self._prefill_picture = reply.snapshot
        for rid, n in reply.ready:
            req = self.prefilling.pop(rid, None)
            if req is not None:               # (an abort may have crossed the reply)
                self.ready[rid] = (req, n)
        landed = [self._import(h, data, seconds) for h, (data, seconds) in zip(reply.sent, moved)]
        for h, transfer in zip(reply.sent, landed):  # (every hand-off landed: an observer may raise)
            if transfer is not None:
                self.observers.emit("transferred", h.request_id, transfer)

    def _import(self, h: Handoff, data: list[torch.Tensor], seconds: float) -> Transfer | None:
        req, t = self.pulling.pop(h.request_id)
        self.command.acks.append(h.request_id)
        if req.finished:                          # aborted while its blocks were on the way
            return None
        seq = self.scheduler.add(req).seqs[0]
        # None: the decode step took the room since the pull; the prompt is recomputed here
        landed = install_blocks(self.block_manager, self.runner.pool, seq, h.num_tokens, data) is not None
        self.transfers[h.request_id] = done = Transfer(h.num_tokens, h.num_blocks,
                                                       h.nbytes(self.layout), seconds,
                                                       time.perf_counter() - t, landed)
        if len(self.transfers) > MAX_TRANSFERS:          # a long-running server keeps the latest
            del self.transfers[next(iter(self.transfers))]
        return done

    def _break(self, error: WorkerError):
        self.broken = self.group.failure(error)
        raise self.broken from None

    # --- the other pool -------------------------------------------------------------------------
    def prefill_snapshot(self) -> MemorySnapshot | None:
        """The prefill worker's pool as its latest reply that carried one drew it (None before
        the first); the next command asks for a fresh one. The pool lives in the other process:
        a picture of it costs a message, so it travels only when someone looks (the dashboard,
        notebook 11)."""
        self._want_picture = True
        return self._prefill_picture

    # --- clean-up -------------------------------------------------------------------------------
    def reset(self) -> list[Request]:
        """Drop every request, here and on the prefill worker (one exchange, so both are between
        steps again)."""
        dropped = []
        for rid in list(self.prefilling) + list(self.ready) + list(self.pulling):
            req = (self.prefilling.pop(rid, None) or self.ready.pop(rid, (None,))[0]
                   or self.pulling[rid][0])
            if rid not in self.pulling:
                self.command.aborts.append(rid)
            if not req.finished:
                dropped.append(end_unadmitted(req, FinishReason.ABORT))
        if self.broken is None:
            try:
                with deferred_interrupt():
                    self._exchange(block=True)     # the reply in flight, if any
                    self._exchange(block=True)     # the aborts and acks, answered
            except WorkerError:
                pass                               # broken now; the caller's next step says so
        self.ready.clear()
        return dropped + super().reset()

    def health_error(self) -> str | None:
        if self.broken is not None:
            return str(self.broken)
        return self.group.dead_worker()

    def close(self) -> None:
        """Stop the prefill worker (also done when the engine is garbage-collected)."""
        self._finalizer()
        self.broken = self.broken or WorkerError("this disagg engine is closed: its prefill "
                                                   "worker is stopped")
