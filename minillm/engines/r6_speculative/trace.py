"""What notebook 06 draws of speculation, watched from outside the engine (``runtime/observe.py``).

``SpeculativeEngine.verify`` emits one ``Verification`` per sequence it verified (phase
"verified"); ``SpecTrace`` collects them, and the pool at every verifying step's fullest moment
(phase "computed": the guesses' K/V written, not yet rolled back):

    spec = engine.observers.add(SpecTrace())
    llm.run(requests)
    spec.verifications[0]   # {"step": 1, "request_id": ..., "guesses": [...], "kept": [...], ...}
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ...memory import MemorySnapshot
from ...runtime.observe import StepEvent


@dataclass(frozen=True)
class Verification:
    """One sequence's verification in one step."""

    context: int               # tokens in the sequence before this step
    guesses: tuple[int, ...]   # what the proposer guessed
    kept: tuple[int, ...]      # what the sequence keeps: a prefix of the guesses + the target's own
    num_accepted: int          # guesses kept (``kept`` may hold one more: the target's token)


class SpecTrace:
    """An observer: every ``Verification`` as a dict with its step and request id
    (``verifications``), and a ``MemorySnapshot`` at each step that verified guesses, taken after
    the forward wrote their K/V and before the rejected ones were given back (``snapshots``, by
    step: not every step verifies — a prefill, or a decode the proposer had no guess for)."""

    def __init__(self):
        self.verifications: list[dict] = []
        self.snapshots: dict[int, MemorySnapshot] = {}

    def __call__(self, event: StepEvent) -> None:
        if event.phase == "computed" and any(s.spec_token_ids for s in event.data):
            self.snapshots[event.step] = replace(event.engine.snapshot(), step=event.step)
        elif event.phase == "verified":
            self.verifications.append({"step": event.step, "request_id": event.request_id,
                                       **asdict(event.data)})
