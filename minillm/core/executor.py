"""Where a step's forward runs, and how many steps may be in flight at once (notebook 03).

The paged engine's step loop (``PagedEngine._step``) is the same for every rung:

    launch steps until ``depth`` are in flight -> land the oldest (its tokens committed)
    -> launch until ``ahead`` are in flight again -> return the landed step's output

An ``Executor`` decides only where the forward of a launched step computes and how many may be
in flight; the engine decides what each step holds (vLLM's ``EngineCore.step_with_batch_queue``
is the same loop over one queue, for pipeline parallelism and async scheduling alike):

- ``InlineExecutor`` (rung 3): the forward runs inside ``launch``; depth 1, nothing ahead. A step
  is launched and landed in one ``step()`` call: schedule, forward, sample, commit.
- rung 7 keeps one step per micro-batch in flight through its ranks (depth = micro-batches);
- rung 12 runs the forward on a worker thread and launches the next step right after landing
  one (depth 1, one ahead), so it computes while the caller streams the landed step's tokens.

A step is scheduled only on committed state: a request in a step in flight is in no other step
(rung 7 leaves it out of the next micro-batch's schedule), and an abort of such a request waits
until its step has landed (``PagedEngine.abort``): its blocks are being written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..runtime.interface import StepOutput
from .scheduler import SchedulerOutput
from .sequence import SequenceGroup


@dataclass(eq=False)
class LaunchedStep:
    """A scheduled step on its way: its plan, the requests in it (no other step may touch them
    until it lands), the executor's handle on its forward, and its result once received."""

    sched: SchedulerOutput
    groups: set[SequenceGroup]
    handle: Any = None
    committed: bool = False     # its K/V already counted (rung 7 commits at launch)
    result: tuple | None = None  # (forward's result, forward ms), once the forward is back
    index: int = 0              # the engine's count of launched steps (rung 7: micro-batch id)


class Executor(Protocol):
    depth: int      # steps launched before the oldest lands
    ahead: int      # steps launched again right after one landed (computing while the caller works)

    def submit(self, fn: Callable[..., Any], *args) -> Any: ...   # -> a handle on fn's result

    def wait(self, handle: Any) -> Any: ...                         # fn's result (or its error)

    def call(self, fn: Callable[..., Any], *args) -> Any: ...      # run fn where forwards run

    def close(self) -> None: ...

    def describe(self) -> dict: ...                                # what views show of it


class InlineExecutor:
    """Rung 3: everything on the caller's thread, one step at a time."""

    depth, ahead = 1, 0

    def submit(self, fn: Callable[..., Any], *args) -> Any:
        return fn(*args)

    def wait(self, handle: Any) -> Any:
        return handle

    def call(self, fn: Callable[..., Any], *args) -> Any:
        return fn(*args)

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        return {}


def split_step_time(out: StepOutput, sched: SchedulerOutput, ms: float) -> None:
    """A mixed step's forward time is split between prefill and decode by token count; a
    verification's 1 + k tokens count as decode (they produce output, not a prompt)."""
    n_all = sched.num_tokens
    n_dec = sum(n for s, n in sched.scheduled if s.spec_token_ids
                or (n == 1 and s.num_computed_tokens >= s.prompt_len))
    out.prefill_ms, out.decode_ms = ms * (n_all - n_dec) / n_all, ms * n_dec / n_all
    out.num_prefill_tokens, out.num_decode_tokens = n_all - n_dec, n_dec
    out.batch_size = len(sched.scheduled)
