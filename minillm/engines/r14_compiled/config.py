"""``CompileConfig``: rung 14's options (notebook 14_compiled). ``paged`` with ``compile=True``
(``--compile``) is this rung's engine."""
from __future__ import annotations

from dataclasses import dataclass

from ...runtime.config import check_bool, option

# nano-vllm's CUDA-graph sizes start 1, 2, 4, 8 (then every 16; vLLM's every 8). A batch of n
# decodes runs in the smallest bucket that holds it, so each shape is compiled once. On a CPU a
# padded row costs what a real one does: with doubling buckets 33 rows ran as 64, and with buckets
# every 16 a 128-request run padded its decode batches (46 rows on average) by ~15% more rows, as
# much as compiling saved (docs/rungs/14_compiled.md). So the buckets stop at 8 -- up to there
# the product's kernel depends on the row count (layers/gemv.py's MAX_ROWS) -- and a larger batch
# runs one graph compiled for any batch size, unpadded (``LARGE``'s "dynamic", vLLM's own choice
# for its compiled graph: dynamic in the token count, CUDA graphs only on top of it).
DEFAULT_BUCKETS = (1, 2, 4, 8)
WRAPPERS = ("python", "cpp")
LARGE = ("dynamic", "eager")


def parse_buckets(text: str | None) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8): positive, increasing; ValueError naming the item otherwise."""
    if text is None:
        return DEFAULT_BUCKETS
    out: list[int] = []
    for item in str(text).replace(";", ",").split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"compile_buckets must be positive integers, e.g. '1,2,4,8'; "
                             f"got {item!r} in {text!r}")
        if out and int(item) <= out[-1]:
            raise ValueError(f"compile_buckets must increase, got {text!r}")
        out.append(int(item))
    return tuple(out)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``n`` rows (never smaller than the batch), or None when
    the batch is larger than every bucket (that step runs eagerly)."""
    if n < 1:
        raise ValueError(f"a decode step has at least one row, got {n}")
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class CompileConfig:
    compile: bool = option(
        False, "compiled (rung 14): run decode steps through torch.compile (inductor's C++ "
               "backend on a CPU), padded to a few batch sizes; with --engine paged it selects "
               "the compiled engine")
    compile_buckets: str | None = option(
        None, "compiled: the batch sizes decode steps are padded to, each compiled once on "
              "first use, e.g. '1,2,4,8' (the default); a larger batch runs as "
              "compile_large_batches says")
    compile_large_batches: str = option(
        "dynamic", "compiled: what a decode batch larger than the last bucket runs: 'dynamic' "
                   "(one graph compiled for any batch size, dynamic shapes, unpadded) or "
                   "'eager' (rung 3's step)")
    compile_wrapper: str = option(
        "python", "compiled: the code around the step's kernels, 'python' (inductor's default) "
                  "or 'cpp' (inductor's C++ wrapper: no Python between the ~150 kernel and "
                  "operator calls of a SmolLM2 step, a tenth more tokens/s at one row in "
                  "docs/rungs/14_compiled.md; its cold compile takes ~6x longer, then the disk "
                  "cache serves it)")

    def __post_init__(self):
        check_bool("compile", self.compile)
        if not self.compile:
            raise ValueError("compile must be True for the compiled engine, got False")
        parse_buckets(self.compile_buckets)
        if self.compile_wrapper not in WRAPPERS:
            raise ValueError(f"compile_wrapper must be one of {', '.join(map(repr, WRAPPERS))}, "
                             f"got {self.compile_wrapper!r}")
        if self.compile_large_batches not in LARGE:
            raise ValueError(f"compile_large_batches must be one of "
                             f"{', '.join(map(repr, LARGE))}, got {self.compile_large_batches!r}")

    @property
    def buckets(self) -> tuple[int, ...]:
        return parse_buckets(self.compile_buckets)


__all__ = ["CompileConfig", "DEFAULT_BUCKETS", "LARGE", "WRAPPERS", "bucket_for", "parse_buckets"]
