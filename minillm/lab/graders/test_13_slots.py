"""Exercise 13-slots — the adapter slots: ``LoRASlots.acquire`` and ``LoRASlots._write``
(``minillm/engines/r13_lora/slots.py``).

Graded against the contract, written out here (``Expected``): sequences of ``acquire`` calls —
hits, free slots, evictions, every slot busy — on slots over small random adapters of different
ranks, modules and scales (one rsLoRA), each call's slot, ``table()``, ``loads``, ``evictions``,
``live`` and every stacked A and B compared with what the contract says: least recently used
first, a hit refreshing it; a slot whose adapter a running request uses never evicted (the
request waits: None); slot s in row s - 1; the adapter's scale folded into B; nothing left of the
adapter evicted before. Then the engine serves three adapters and base rows with two slots, and
with one slot (requests wait for it), and every request must equal Hugging Face on its adapter's
merged weights.

The calls run in the student's process (``probe_*``, the ``student`` fixture) and send back what
they saw, judged here.
"""
from __future__ import annotations

import pytest
import torch

from minillm.lab.reference import (assert_greedy_match, merged_references, random_prompts,
                                   serve_loras)

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {"q_proj": (6, 5), "k_proj": (3, 5), "v_proj": (3, 5), "o_proj": (5, 6),
          "gate_proj": (7, 5), "up_proj": (7, 5), "down_proj": (5, 7)}
LAYERS, MAX_RANK = 2, 4
# name -> (rank, modules, scale): a hit on one slot may be followed by a smaller rank or fewer
# modules in it (what is left of the one before must go)
ADAPTERS = {"a": (4, TARGETS, 2.0), "b": (2, ("q_proj", "v_proj"), 0.5),
            "c": (1, ("gate_proj", "down_proj"), 3.0), "d": (3, ("o_proj", "up_proj"), 2 / 3 ** 0.5),
            "e": (2, TARGETS, 1.0)}


def adapter(name: str):
    """``ADAPTERS[name]`` as a ``LoRAAdapter``, seeded by its name."""
    from minillm.engines.r13_lora.adapter import LoRAAdapter
    r, modules, scale = ADAPTERS[name]
    g = torch.Generator().manual_seed(ord(name))
    weights = {(layer, m): (torch.randn(r, SHAPES[m][1], generator=g, dtype=torch.float64),
                            torch.randn(SHAPES[m][0], r, generator=g, dtype=torch.float64))
               for layer in range(LAYERS) for m in modules}
    return LoRAAdapter(name, r, scale, weights)


class Expected:
    """What the slots hold after each ``acquire``, by the contract (``slots.py``'s docstring)."""

    def __init__(self, num_slots: int):
        self.names: list[str | None] = [None] * (num_slots + 1)
        self.order: list[str] = []           # resident adapters, least recently used first
        self.loaded: list[str] = []          # resident adapters, first loaded first
        self.loads = self.evictions = 0
        self.victim: str | None = None       # the adapter the last call evicted

    def acquire(self, name: str, busy: set[str]) -> int | None:
        self.victim = None
        if name in self.order:
            self.order.remove(name)
            self.order.append(name)
            return self.names.index(name)
        free = [s for s in range(1, len(self.names)) if self.names[s] is None]
        if free:
            slot = free[0]
        else:
            idle = [n for n in self.order if n not in busy]
            if not idle:
                return None
            self.victim = idle[0]
            slot = self.names.index(self.victim)
            self.order.remove(self.victim)
            self.loaded.remove(self.victim)
            self.evictions += 1
        self.names[slot] = name
        self.order.append(name)
        self.loaded.append(name)
        self.loads += 1
        return slot

    def stacks(self) -> tuple[dict, dict]:
        """Every stacked A and B: row s - 1 holds slot s's adapter (A[:r], scale * B[:, :r]),
        zeros wherever it adapts nothing."""
        n = len(self.names) - 1
        A = {(i, m): torch.zeros(n, MAX_RANK, SHAPES[m][1], dtype=torch.float64)
             for i in range(LAYERS) for m in TARGETS}
        B = {(i, m): torch.zeros(n, SHAPES[m][0], MAX_RANK, dtype=torch.float64)
             for i in range(LAYERS) for m in TARGETS}
        for s, name in enumerate(self.names[1:], start=1):
            if name is not None:
                ad = adapter(name)
                for key, (a, b) in ad.weights.items():
                    A[key][s - 1, :ad.rank] = a
                    B[key][s - 1, :, :ad.rank] = b * ad.scale
        return A, B

    def live(self) -> dict[str, list[int]]:
        return {m: sorted(s for s, n in enumerate(self.names) if n is not None
                          and m in ADAPTERS[n][1]) for m in TARGETS}


# (name, busy): each a call of acquire; 2 and 3 slots
RUNS = {
    "least-recently-used": (3, [("a", []), ("b", []), ("c", []), ("b", []), ("d", []),
                                ("e", [])]),
    "fill-hit-evict": (2, [("a", []), ("b", []), ("a", []), ("c", []), ("b", []), ("a", ["b"]),
                           ("d", ["a"]), ("e", []), ("a", [])]),
    "every-slot-busy": (2, [("a", []), ("b", []), ("c", ["a", "b"]), ("c", ["a"]),
                            ("d", ["c", "a"]), ("a", ["c"]), ("e", ["a", "c"]), ("b", [])]),
    "three-slots": (3, [("c", []), ("a", []), ("e", []), ("c", []), ("b", ["a"]), ("d", []),
                        ("e", ["e", "b"]), ("a", ["d"]), ("c", ["a", "e"]), ("b", ["c", "a"]),
                        ("d", ["a", "b", "c"])]),
    "one-slot": (1, [("b", []), ("b", ["b"]), ("c", ["b"]), ("c", []), ("a", []), ("d", ["a"])]),
}


def probe_acquire(num_slots: int, calls: list) -> dict:
    """``LoRASlots`` (2 layers, ``num_slots`` slots, rank up to 4, fp64) told ``calls``: after
    each, its answer and the state of the slots."""
    from minillm.engines.r13_lora.slots import LoRASlots
    slots = LoRASlots(SHAPES, LAYERS, num_slots, MAX_RANK, "cpu", torch.float64)
    seen = []
    for name, busy in calls:
        try:
            slot = slots.acquire(adapter(name), set(busy))
        except NotImplementedError:
            raise
        except Exception as e:      # noqa: BLE001 - judged here, with the calls before it
            seen.append({"raised": f"{type(e).__name__}: {e}"})
            break
        seen.append({"raised": None, "slot": slot, "table": [[s, n] for s, n in slots.table()],
                     "loads": int(slots.loads), "evictions": int(slots.evictions),
                     "live": {m: sorted(int(s) for s in slots.live[m]) for m in TARGETS},
                     "A": {f"{i}.{m}": t.clone() for (i, m), t in slots.A.items()},
                     "B": {f"{i}.{m}": t.clone() for (i, m), t in slots.B.items()}})
    return {"seen": seen}


def judge_call(k: int, calls: list, exp: Expected, before: list, got: dict) -> None:
    name, busy = calls[k]
    call = f"call {k + 1}, acquire({name!r}, busy={set(busy) or '{}'})"
    held = {n: s for s, n in enumerate(before) if n is not None}
    order, loaded = list(exp.order), list(exp.loaded)
    want = exp.acquire(name, set(busy))
    history = f" (the calls: {[c[0] for c in calls[:k + 1]]})"
    assert got["raised"] is None, f"{call} raised {got['raised']}{history}"
    slot = got["slot"]
    if slot != want:
        taken = before[slot] if isinstance(slot, int) and 0 < slot < len(before) else None
        if name in held:
            raise AssertionError(f"{call}: {name!r} is resident in slot {held[name]}, got "
                                 f"{slot!r}: a resident adapter keeps its slot (and becomes the "
                                 f"most recently used)")
        if taken is not None and taken in busy:
            raise AssertionError(
                f"{call} took slot {slot} from {taken!r}, which a running request uses (it is in "
                f"busy): that request would go on decoding with {name!r}'s weights. Never evict "
                f"a busy adapter; when every slot is busy, return None (the request waits)")
        if want is None:
            raise AssertionError(f"{call}: every slot's adapter is busy: return None (the "
                                 f"request waits), got {slot!r}")
        if slot is None:
            raise AssertionError(
                f"{call} returned None, but slot {want} can be had ("
                + ("it is free" if exp.victim is None else f"{exp.victim!r}, least recently "
                   "used and not busy, is evicted") + f"): a request would wait for nothing")
        if exp.victim is None and taken is not None:
            raise AssertionError(f"{call} evicted {taken!r} from slot {slot} while slot {want} "
                                 f"is free: take a free slot (the lowest) before evicting")
        if taken is not None:
            idle = [n for n in order if n not in busy]
            by_load = [n for n in loaded if n not in busy]
            why = (": a hit is a use too (acquiring a resident adapter makes it the most recently "
                   "used: move_to_end); you evicted the one loaded first" if by_load
                   and taken == by_load[0] else ": you evicted the most recently used" if idle
                   and taken == idle[-1] else "")
            raise AssertionError(
                f"{call} evicted {taken!r}; the least recently used adapter not busy is "
                f"{exp.victim!r} (idle ones, least recently used first: {idle}){why}{history}")
        raise AssertionError(f"{call} returned {slot!r}, want {want}{history}")
    want_table = [[s, n] for s, n in enumerate(exp.names) if s > 0]
    assert got["table"] == want_table, (
        f"{call}: the slots hold {got['table']}, want {want_table} (names[slot] is the adapter "
        f"written in it){history}")
    assert got["evictions"] == exp.evictions, (
        f"{call}: self.evictions is {got['evictions']}, want {exp.evictions} (one per adapter "
        "written over)")
    assert got["loads"] == exp.loads, (
        f"{call}: self.loads is {got['loads']}, want {exp.loads} (one per adapter written into a "
        "slot; a hit loads nothing)")
    judge_stacks(call, exp, got)
    assert got["live"] == exp.live(), (
        f"{call}: live is {got['live']}, want {exp.live()}: live[m] holds exactly the slots whose "
        "adapter adapts m (sgmv skips the others: an adapted module left out runs without its "
        "delta, a slot left in after its adapter went is computed for nothing)")


def judge_stacks(call: str, exp: Expected, got: dict) -> None:
    A, B = exp.stacks()
    for (i, m), a_want in A.items():
        a, b = got["A"][f"{i}.{m}"], got["B"][f"{i}.{m}"]
        b_want = B[i, m]
        if torch.allclose(a, a_want) and torch.allclose(b, b_want):
            continue
        for s, name in enumerate(exp.names[1:], start=1):
            row = s - 1
            if name is None:
                continue
            r, modules, scale = ADAPTERS[name]
            if m not in modules:
                continue
            if torch.allclose(a[row], a_want[row]) and scale != 1 and \
                    torch.allclose(b[row] * scale, b_want[row]):
                raise AssertionError(
                    f"{call}: slot {s} ({name!r}, scale {scale:g}) holds B, not scale * B: the "
                    "scale (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA) is folded into "
                    "B when it is written; forgotten, every delta of the adapter is off by it")
            if row + 1 < a.shape[0] and torch.allclose(a[row + 1], a_want[row]):
                raise AssertionError(f"{call}: slot {s}'s weights are in row {row + 1} of the "
                                     f"stacked tensors: slot s is row s - 1 (slot 0, the base "
                                     f"model, stores nothing)")
        stale = [s for s in range(1, len(exp.names))
                 if (a_want[s - 1] == 0).all() and not (a[s - 1] == 0).all()
                 or ((a_want[s - 1] == 0) & (a[s - 1] != 0)).any()
                 or ((b_want[s - 1] == 0) & (b[s - 1] != 0)).any()]
        if stale:
            s = stale[0]
            raise AssertionError(
                f"{call}: slot {s} ({exp.names[s]!r}) holds values in layer {i}'s {m} where it "
                f"should hold zeros (a module it does not adapt, or the ranks past its own): what "
                f"the adapter evicted from it left behind. Clear the slot's row of every A and B "
                f"before writing")
        raise AssertionError(f"{call}: layer {i}'s {m}: the stacked A or B differs from the "
                             f"adapters written (A[s - 1, :r] = A, B[s - 1, :, :r] = scale * B)")


@pytest.mark.parametrize("run", list(RUNS))
def test_acquire_follows_the_contract_call_by_call(student, run):
    num_slots, calls = RUNS[run]
    seen = student.run(probe_acquire, num_slots, calls)["seen"]
    exp = Expected(num_slots)
    for k, got in enumerate(seen):
        judge_call(k, calls, exp, list(exp.names), got)
    assert len(seen) == len(calls)


NAMES = [None, "qv", "mlp", "all", "qv", None, "all", "mlp"]
PROMPTS = random_prompts(len(NAMES), seed=3, hi=24)
MAX_TOKENS = 8
_REFS: list = []


def probe_serve(max_loras: int) -> dict:
    from minillm import load_model
    model = load_model("tiny-llama", dtype=torch.float32)
    return serve_loras(model, NAMES, PROMPTS, MAX_TOKENS, max_loras=max_loras)


@pytest.mark.parametrize("max_loras", [2, 1])
def test_three_adapters_in_fewer_slots_equal_their_merged_weights(student, max_loras):
    """Base rows and three adapters (ranks 2, 8, 4; attention, MLP, all seven projections; one
    rsLoRA) with two slots, then one: adapters are swapped, requests wait for a slot and none
    fails, and every request equals Hugging Face on its merged model."""
    got = student.run(probe_serve, max_loras)
    assert not any(got["errors"]), f"requests failed: {got['errors']}"
    assert got["evictions"] > 0, f"{max_loras} slot(s) for 3 adapters: some must be evicted"
    if not _REFS:
        from minillm import load_model
        _REFS.extend(merged_references(load_model("tiny-llama", dtype=torch.float32), NAMES,
                                       PROMPTS, MAX_TOKENS))
    for i, (name, tokens, ref) in enumerate(zip(NAMES, got["tokens"], _REFS)):
        assert_greedy_match(tokens, ref, label=f"max_loras={max_loras}: request {i} (adapter "
                                              f"{name or 'none: the base model'})")
    assert got["full"], "blocks leaked: the pool is not full again after every request"
