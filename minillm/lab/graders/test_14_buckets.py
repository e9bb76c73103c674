"""Exercise 14-buckets — the bucket a decode batch is padded to: ``bucket_for`` and
``parse_buckets`` (``minillm/engines/r14_compiled/config.py``).

Graded exhaustively against a reference written here from the definition: ``bucket_for`` on every
increasing list of buckets drawn from 1..9 (511 of them) and every batch 0..11, and on the
default buckets up to 130 rows; ``parse_buckets`` on valid texts (spaces, semicolons, one
bucket, None for the default) and on every kind of text the option must refuse (0, negative,
not an integer, empty, equal or decreasing), whose ValueError must name ``compile_buckets`` — the
option the user set. Last, ``CompileConfig`` (the engine's option,
which calls your ``parse_buckets``) accepts and refuses the same texts.

The tests go from the most harmful mistake to the least: a bucket smaller than the batch (the
padded step would drop rows), a bucket for a batch above every bucket (it must run eagerly),
then a missing bucket, then one larger than needed.

Every call of your functions happens in your process (``probe_*``, the ``student`` fixture);
what they return or raise is judged here.
"""
from __future__ import annotations

from itertools import combinations

import pytest

from minillm.engines.r14_compiled.config import DEFAULT_BUCKETS

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
DEFAULT = DEFAULT_BUCKETS     # what None names: the engine's own default


def reference_bucket(n: int, buckets: tuple[int, ...]):
    """The smallest bucket that holds n, None above the largest, "ValueError" for n < 1."""
    if n < 1:
        return "ValueError"
    return min((b for b in buckets if b >= n), default=None)


def reference_parse(text):
    """The buckets text names, or "ValueError"."""
    if text is None:
        return DEFAULT
    out = []
    for item in text.replace(";", ",").split(","):
        item = item.strip()
        if not item or not all(c in "0123456789" for c in item) or int(item) < 1 \
                or (out and int(item) <= out[-1]):
            return "ValueError"
        out.append(int(item))
    return tuple(out)


def bucket_cases() -> list[tuple[int, tuple[int, ...]]]:
    lists = [c for k in range(1, 10) for c in combinations(range(1, 10), k)]
    return ([(n, b) for b in lists for n in range(-1, 12)]
            + [(n, DEFAULT) for n in range(0, 131)])


def probe_bucket_for(cases: list) -> list:
    """``bucket_for(n, buckets)`` for each case: ("ok", value) or ("raised", type name)."""
    from minillm.engines.r14_compiled import config
    out = []
    for n, buckets in cases:
        try:
            out.append(("ok", config.bucket_for(n, tuple(buckets))))
        except NotImplementedError:
            raise
        except Exception as e:       # noqa: BLE001 - judged here: ValueError or not
            out.append(("raised", type(e).__name__))
    return out


_GOT: dict = {}


def results(student) -> list:
    """Every case's (n, buckets, want, got), computed once in the student's process."""
    if "bucket_for" not in _GOT:
        cases = bucket_cases()
        _GOT["bucket_for"] = [(n, b, reference_bucket(n, b), got) for (n, b), got in
                              zip(cases, student.run(probe_bucket_for, cases), strict=True)]
    return _GOT["bucket_for"]


def first(rows, bad) -> tuple | None:
    return next((r for r in rows if bad(*r)), None)


def returned(got) -> object:
    return got[1] if got[0] == "ok" else f"raised {got[1]}"


def test_bucket_for_never_pads_to_a_bucket_smaller_than_the_batch(student):
    """Batches that some bucket holds (1 <= n <= the largest); above it, the next test."""
    rows = [r for r in results(student) if 1 <= r[0] <= r[1][-1]]
    bad = first(rows, lambda n, b, want, got: got[0] == "ok" and isinstance(got[1], int)
                and got[1] < n)
    assert bad is None, (
        f"bucket_for({bad[0]}, {bad[1]}) = {bad[3][1]}: a bucket smaller than the batch of "
        f"{bad[0]} row(s) (the padded step would drop rows); want {bad[2]}, the smallest "
        "bucket >= n")


def test_bucket_for_gives_none_above_the_largest_bucket(student):
    bad = first(results(student), lambda n, b, want, got: n > b[-1] and got != ("ok", None))
    assert bad is None, (
        f"bucket_for({bad[0]}, {bad[1]}) = {returned(bad[3])}: {bad[0]} rows are more than "
        f"every bucket holds: return None (that step runs eagerly)")


def test_bucket_for_refuses_a_batch_of_no_rows(student):
    bad = first(results(student), lambda n, b, want, got: n < 1 and got != ("raised",
                                                                              "ValueError"))
    assert bad is None, (
        f"bucket_for({bad[0]}, {bad[1]}) = {returned(bad[3])}: a decode step has at least one "
        "row: raise ValueError for n < 1")


def test_bucket_for_is_the_smallest_bucket_that_holds_the_batch(student):
    bad = first(results(student), lambda n, b, want, got: n >= 1 and got != ("ok", want))
    if bad is None:
        return
    n, b, want, got = bad
    why = "the smallest bucket >= n"
    if got == ("ok", None) or got[0] == "raised":
        why = (f"bucket {want} holds {n} row(s)" + (" (a bucket equal to the batch holds it: >=, "
                                                  "bisect_left)" if want == n else ""))
    elif got[1] == b[-1]:
        why = f"the largest bucket is not the smallest that holds {n} row(s) ({want})"
    elif want == n:
        why = (f"a bucket equal to the batch holds it: {n} rows go to bucket {n} (>=, not >; "
               "bisect_left, not bisect_right)")
    raise AssertionError(f"bucket_for({n}, {b}) = {returned(got)}, want {want}: {why}")


# --- parse_buckets ------------------------------------------------------------------------------
VALID = [None, "1,2,4,8", "1", "16", " 1, 2 ;8", "3,5,6,100", "1;2;3", "2, 4,8 ",
         "1,2,3,4,5,6,7,8,9,10", "64,128,256"]
ZERO_OR_NEGATIVE = ["0", "0,1", "1,0", "1,2,0", "-1", "-1,2", "2,-4", " 0 "]
NOT_INTEGERS = ["x", "1,x", "2.5", "1, 2.5", "", "four", "1 2", "8,16,3e2"]
NOT_INCREASING = ["2,2", "4,2", "1,3,2", "1,2,4,4", "8;4;2;1", "1, 1"]


def probe_parse(texts: list) -> list:
    """``parse_buckets(text)``: ("ok", value, its type's name) or ("raised", type, message)."""
    from minillm.engines.r14_compiled import config
    out = []
    for text in texts:
        try:
            got = config.parse_buckets(text)
            out.append(("ok", list(got) if isinstance(got, (list, tuple)) else repr(got),
                        type(got).__name__))
        except NotImplementedError:
            raise
        except Exception as e:       # noqa: BLE001 - judged here
            out.append(("raised", type(e).__name__, str(e)[:500]))
    return out


def test_parse_buckets_reads_commas_semicolons_and_spaces(student):
    for text, got in zip(VALID, student.run(probe_parse, VALID), strict=True):
        want = reference_parse(text)
        default = " (None: the default buckets, DEFAULT_BUCKETS)" if text is None else ""
        assert got[0] == "ok", \
            f"parse_buckets({text!r}) raised {got[1]}: {got[2]}; want {want}{default}"
        assert tuple(got[1]) == want, f"parse_buckets({text!r}) = {got[1]}, want {want}{default}"
        assert got[2] == "tuple", f"parse_buckets({text!r}) must return a tuple, got a {got[2]}"


@pytest.mark.parametrize("texts, rule", [
    (ZERO_OR_NEGATIVE, "every bucket is a positive integer (a batch has at least one row)"),
    (NOT_INTEGERS, "every item is a positive integer"),
    (NOT_INCREASING, "the buckets must increase (each larger than the one before: equal ones "
                     "are one bucket written twice)")],
    ids=["zero-or-negative", "not-an-integer", "not-increasing"])
def test_parse_buckets_refuses_what_is_not_a_list_of_buckets(student, texts, rule):
    for text, got in zip(texts, student.run(probe_parse, texts), strict=True):
        assert reference_parse(text) == "ValueError"       # the cases themselves: all refused
        assert got[0] == "raised" and got[1] == "ValueError", (
            f"parse_buckets({text!r}) = "
            f"{got[1] if got[0] == 'ok' else f'raised {got[1]}: {got[2]}'}: {rule}: raise "
            "ValueError")


def test_parse_buckets_errors_name_the_option(student):
    texts = ZERO_OR_NEGATIVE + NOT_INTEGERS + NOT_INCREASING
    for text, got in zip(texts, student.run(probe_parse, texts), strict=True):
        assert got[0] == "raised", f"parse_buckets({text!r}) must raise ValueError"
        assert "compile_buckets" in got[2], (
            f"parse_buckets({text!r}) raised {got[1]}({got[2]!r}): the message must name the "
            "option the user set, compile_buckets, and say what is wrong with it (a bare int() "
            "error, 'invalid literal for int()', says neither)")


def probe_config(texts: list) -> list:
    from minillm.engines.r14_compiled.config import CompileConfig
    out = []
    for text in texts:
        try:
            out.append(("ok", list(CompileConfig(True, text).buckets)))
        except NotImplementedError:
            raise
        except Exception as e:       # noqa: BLE001 - judged here
            out.append(("raised", type(e).__name__, str(e)[:500]))
    return out


def test_the_engine_s_option_is_read_by_your_parse_buckets(student):
    texts = [None, "1,3", " 2 ; 8", "4,2", "0", "2.5"]
    for text, got in zip(texts, student.run(probe_config, texts), strict=True):
        want = reference_parse(text)
        where = f"CompileConfig(compile=True, compile_buckets={text!r})"
        if want == "ValueError":
            assert got[0] == "raised" and got[1] == "ValueError" and "compile_buckets" in got[2], \
                f"{where}: must be refused with a ValueError naming compile_buckets, got {got}"
        else:
            assert got == ("ok", list(want)), f"{where}.buckets = {got}, want {want}"
