"""Observers: how a view watches the real engine from inside a step (notebooks 05 and 06).

A view never keeps state in the engine's objects and never copies its step: it registers a
callable on ``engine.observers`` and receives a ``StepEvent`` at each phase of every step.

Phases, in the order they happen within one step:
- ``"preempted"`` — the scheduler evicted the running request ``request_id`` for a waiting one
  the policy ranks ahead of it (``data``: that request's id; ``core/policy.py``). Evictions for
  memory are counted in ``Request.num_preemptions`` and the engine's ``num_preemptions``.
- ``"executed"`` — the forward pass ran (``data``: its ``(start, end)`` in ``time.perf_counter()``
  seconds, the copies and the forward; ``PagedEngine.execute``). Rung 12's overlapped step runs
  the forward on a worker thread and this event comes from there, while the caller is between
  steps: a timeline of compute against host work (notebook 12, ``bench/async_step.py``).
- ``"computed"`` — the forward pass ran: every K/V of the step is written and nothing is
  committed yet, so the pool is at its fullest (rung 6: guesses' slots still held). ``data``:
  the sequences whose logits came back (``PagedEngine.complete``).
- ``"beam"`` — one request's beam search chose its continuations (``data``: the
  ``core.beam.BeamChoice``); a trace records them so the visualizer can replay the search.
- ``"verified"`` — rung 6 verified one sequence's guesses (``data``: a ``Verification``).
- ``"transferred"`` — rung 11: a request's prompt blocks arrived from the prefill worker and
  were written into this pool (``request_id``; ``data``: the ``r11_disagg.engine.Transfer``:
  tokens, blocks, bytes, seconds). The server's ``/metrics`` counts them.
- ``"controlled"`` — rung 12's batch controller moved the step's token budget after measuring a
  step (``data``: a ``engines.r12_realtime.batch_controller.BatchDecision``: old and new cap, the fit).
- ``"stepped"`` — the step is over (``data``: its ``StepOutput``); every engine emits it.

``StepEvent.step`` is the step of the current run, counted from 1 like ``StepRecord.step``.
An observer that raises fails the step, as any step error does: ``Engine.run`` resets the
engine and aborts the run's requests, so the pool is full again and the engine usable.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

# The engine a step event comes from: ``runtime/interface.py``'s ``Engine``, which imports this
# module (every engine owns its observers), so it is not imported back for a type hint.
Engine = Any

Phase = Literal["preempted", "executed", "computed", "beam", "verified", "transferred",
                "controlled", "stepped"]
PHASES: tuple[Phase, ...] = ("preempted", "executed", "computed", "beam", "verified",
                             "transferred", "controlled", "stepped")


@dataclass(frozen=True)
class StepEvent:
    phase: Phase
    step: int                    # this run's step, from 1 (``StepRecord.step``)
    engine: Engine               # to read or snapshot (never to change)
    request_id: str | None = None
    data: object = None          # what the phase carries (see the module)


Observer = Callable[[StepEvent], None]


class Observers:
    """One engine's observers. ``emit`` costs a dict lookup when nobody watches that phase: an
    observer may watch some phases only (the server's metrics watch ``"transferred"``), and the
    other phases of every step then cost it nothing."""

    def __init__(self, engine: Engine):
        # A weak reference: the engine holds its observers (and its scheduler their ``emit``), so a
        # strong one back would make a reference cycle, and an engine's KV pool (a GiB) would then
        # wait for the garbage collector instead of going when its last user lets go of it.
        self._engine = weakref.ref(engine)
        self._fns: list[tuple[Observer, frozenset]] = []
        self._by_phase: dict[str, list[Observer]] = {p: [] for p in PHASES}

    @property
    def engine(self) -> Engine:
        return self._engine()

    def __bool__(self) -> bool:
        return bool(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def wants(self, phase: Phase) -> bool:
        """Whether anyone watches ``phase`` (skip building an event's data when nobody does)."""
        return bool(self._by_phase[phase])

    def add(self, fn: Observer, phases: tuple[Phase, ...] = PHASES) -> Observer:
        """Watch every later step's ``phases`` (all by default); returns ``fn``, so
        ``trace = engine.observers.add(T())``."""
        if not callable(fn):
            raise TypeError(f"an observer must be callable with a StepEvent, got {fn!r}")
        unknown = set(phases) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown observer phases {sorted(unknown)}: choose from "
                             f"{', '.join(PHASES)}")
        self._set(self._fns + [(fn, frozenset(phases))])
        return fn

    def remove(self, fn: Observer) -> None:
        self._set([(f, p) for f, p in self._fns if f is not fn])

    def _set(self, fns: list[tuple[Observer, frozenset]]) -> None:
        # new lists: a step iterating the old ones is unaffected
        self._fns = fns
        self._by_phase = {p: [f for f, phases in fns if p in phases] for p in PHASES}

    @contextmanager
    def watching(self, fn: Observer, phases: tuple[Phase, ...] = PHASES) -> Iterator[Observer]:
        """``with engine.observers.watching(recorder):`` — watch for the block only."""
        self.add(fn, phases)
        try:
            yield fn
        finally:
            self.remove(fn)

    def emit(self, phase: Phase, request_id: str | None = None, data: object = None) -> None:
        fns = self._by_phase[phase]
        if not fns:
            return
        engine = self.engine
        event = StepEvent(phase, engine.step_count + 1, engine, request_id, data)
        for fn in fns:
            fn(event)
