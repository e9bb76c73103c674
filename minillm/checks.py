"""The checks every value a user sends passes (``SamplingParams``, ``Request``, the engines'
configs): a bad one is a ``ValueError`` naming the field and the value, raised when the object is
made, never mid-step inside the engine; a ``FieldError`` (a ValueError) also names the field as
data, for a server to name it in its error without parsing the message."""
from __future__ import annotations

import math
import numbers

# The range of every integer a user can send (HTTP, a JSONL line, the Python API), checked when a
# SamplingParams or Request is made. Unbounded, a 400-digit max_tokens or priority would pass
# every check and reach the score policy's float arithmetic inside the scheduler's step
# (OverflowError: int too large to convert to float), failing every request in flight. The
# bounds are vLLM's C types: int32 for counts, token ids and priority, int64 for `seed`, as
# vLLM's OpenAI server bounds it (torch.long; our sampler seeds `random.Random`, which takes
# any int, and torch.Generator.manual_seed takes [-2**63, 2**64 - 1]). Any accepted value is a
# float of at most 2**63 in magnitude:
# rung 8's and 12's policy keys stay finite (tests/rungs/test_r08_policy.py proves it for every policy).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
FIELD_RANGES: dict[str, tuple[int, int]] = {
    "max_tokens": (1, INT32_MAX),
    "top_k": (0, INT32_MAX),
    "seed": (INT64_MIN, INT64_MAX),
    "n": (1, INT32_MAX),             # the engine then caps it by its budget (validate)
    "beam_width": (1, INT32_MAX),
    "stop_token_ids[]": (0, INT32_MAX),
    "priority": (-2**31, INT32_MAX),
}


class FieldError(ValueError):
    """A ValueError about one field, which it names: ``field`` is the field's name as the caller
    spelled it (``"min_tokens"``, ``"structured_outputs.choice"``), so a server can say which
    field was wrong (its error's ``param``) without reading the message."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def show(value) -> str:
    """``value`` for an error message; a huge integer by its size (its repr could be thousands of
    digits, and Python refuses to print more than 4,300)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return repr(value)
    bits = abs(int(value)).bit_length()
    if bits <= 64:
        return repr(value)
    digits = len(str(abs(int(value)))) if bits <= 14_000 else \
        f"about {math.floor(math.log10(abs(int(value)))) + 1}"
    return f"{'a negative' if value < 0 else 'an'} integer of {digits} digits"


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None,
              field: str | None = None) -> int:
    """``value`` as a plain int, or a ``FieldError`` that names the field and the value
    (``field``: the field it belongs to, when ``name`` says more, e.g. ``"logit_bias key"``).

    Integer-like values (numpy ints) are accepted; bools, floats and strings are not. With a
    ``maximum``, both bounds are inclusive."""
    field = field or name
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FieldError(field, f"{name} must be an integer, got {value!r} "
                                f"({type(value).__name__})")
    low = minimum is not None and value < minimum
    if maximum is not None and (low or value > maximum):
        raise FieldError(field, f"{name} must be an integer in [{minimum}, {maximum}], got "
                                f"{show(value)}")
    if low:
        raise FieldError(field, f"{name} must be an integer >= {minimum}, got {show(value)}")
    return int(value)


def check_field(name: str, value, field: str | None = None) -> int:
    """``check_int`` with the range ``FIELD_RANGES`` gives the user-sent field ``name``."""
    return check_int(name, value, *FIELD_RANGES[name], field=field)


def check_float(name: str, value, field: str | None = None) -> float:
    """``value`` as a finite float, or a ``FieldError`` that names the field and the value."""
    field = field or name
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FieldError(field, f"{name} must be a number, got {value!r} "
                                f"({type(value).__name__})")
    if not math.isfinite(value):
        raise FieldError(field, f"{name} must be a finite number, got {value!r}")
    return float(value)
