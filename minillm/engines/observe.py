"""Observers: how a view watches the real engine from inside a step (notebooks 05 and 06).

A view never keeps state in the engine's objects and never copies its step: it registers a
callable on ``engine.observers`` and receives a ``StepEvent`` at each phase of every step.

Phases, in the order they happen within one step:
- ``"preempted"`` — the scheduler evicted the running request ``request_id`` for a waiting one
  the policy ranks ahead of it (``data``: that request's id; ``core/policy.py``). Evictions for
  memory are counted in ``Request.num_preemptions`` and the engine's ``num_preemptions``.
- ``"computed"`` — the forward pass ran: every K/V of the step is written and nothing is
  committed yet, so the pool is at its fullest (rung 6: guesses' slots still held). ``data``:
  the sequences whose logits came back (``PagedEngine.complete``).
- ``"beam"`` — one request's beam search chose its continuations (``data``: the
  ``core.beam.BeamChoice``); a trace records them so the visualizer can replay the search.
- ``"verified"`` — rung 6 verified one sequence's guesses (``data``: a ``Verification``).
- ``"transferred"`` — rung 11: a request's prompt blocks arrived from the prefill worker and
  were written into this pool (``request_id``; ``data``: the ``r11_disagg.engine.Transfer``:
  tokens, blocks, bytes, seconds). The server's ``/metrics`` counts them.
- ``"stepped"`` — the step is over (``data``: its ``StepOutput``); every engine emits it.

``StepEvent.step`` is the step of the current run, counted from 1 like ``StepRecord.step``.
An observer that raises fails the step, as any step error does: ``Engine.run`` resets the
engine and aborts the run's requests, so the pool is full again and the engine usable.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Literal

if TYPE_CHECKING:
    from .base import Engine

Phase = Literal["preempted", "computed", "beam", "verified", "transferred", "stepped"]
PHASES: tuple[Phase, ...] = ("preempted", "computed", "beam", "verified", "transferred",
                             "stepped")


@dataclass(frozen=True)
class StepEvent:
    phase: Phase
    step: int                    # this run's step, from 1 (``StepRecord.step``)
    engine: Engine               # to read or snapshot (never to change)
    request_id: str | None = None
    data: object = None          # what the phase carries (see the module)


Observer = Callable[[StepEvent], None]


class Observers:
    """One engine's observers. ``emit`` costs a truth test when nobody watches."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._fns: list[Observer] = []

    def __bool__(self) -> bool:
        return bool(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def add(self, fn: Observer) -> Observer:
        """Watch every later step (returns ``fn``, so ``trace = engine.observers.add(T())``)."""
        if not callable(fn):
            raise TypeError(f"an observer must be callable with a StepEvent, got {fn!r}")
        self._fns = self._fns + [fn]      # a new list: a step iterating the old one is unaffected
        return fn

    def remove(self, fn: Observer) -> None:
        self._fns = [f for f in self._fns if f is not fn]

    @contextmanager
    def watching(self, fn: Observer) -> Iterator[Observer]:
        """``with engine.observers.watching(recorder):`` — watch for the block only."""
        self.add(fn)
        try:
            yield fn
        finally:
            self.remove(fn)

    def emit(self, phase: Phase, request_id: str | None = None, data: object = None) -> None:
        if not self._fns:
            return
        event = StepEvent(phase, self.engine.step_count + 1, self.engine, request_id, data)
        for fn in self._fns:
            fn(event)
