"""``CompiledRunner``: rung 3's runner whose decode steps run compiled (notebook 14_compiled).

A step of one-token decodes -- the step a running batch takes over and over -- runs through
``torch.compile(DecodeGraph)``: inductor's C++ backend on a CPU. A small batch is padded to its
bucket (``bucket_for``: the smallest of ``compile_buckets`` that holds it), one graph per bucket;
a batch larger than every bucket runs one graph compiled with its batch size symbolic (dynamic
shapes: ``compile_large_batches="dynamic"``), unpadded -- on a CPU a padded row costs what a real
one does. Each graph is compiled the first time it is met (a progress line, then its time) and
kept in inductor's on-disk cache (``use_disk_cache``), so the next process loads it instead.
Padding rows are token 0 at position 0; their K/V are never written and their logits are
dropped. Every other step -- prefill chunks, mixed steps, guesses (rung 6), prompt logprobs --
runs eagerly, as rung 3's runner does.
"""
from __future__ import annotations

import sys
import threading
import time
import types

import torch
from torch import nn

from ...core.runner import ModelRunner
from ...layers.attention.cpp import CppAttention
from ...layers.gemv import MAX_ROWS
from .config import bucket_for
from .graph import DecodeGraph
from .ops import StepContext, step_context


# the dynamic graph's largest batch: a bound no engine's step reaches, the same in every process
# (so inductor's disk cache, keyed on the graph and its symbols' ranges, serves the next one)
ANY_BATCH_MAX = 1 << 16


def use_disk_cache() -> str:
    """Inductor's on-disk caches, on: the FX graph cache (a graph seen before, in any process,
    is loaded instead of lowered again) and its compiled C++, under ``$TORCHINDUCTOR_CACHE_DIR``
    (default ``/tmp/torchinductor_$USER``). Returns the folder."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    config.fx_graph_cache = True
    return cache_dir()


class CompiledRunner(ModelRunner):
    def __init__(self, model, num_blocks: int, block_size: int, backend, *,
                 buckets: tuple[int, ...], wrapper: str = "python", large: str = "dynamic",
                 progress=None, **options):
        super().__init__(model, num_blocks, block_size, backend, **options)
        self.buckets, self.wrapper = buckets, wrapper
        # the dynamic graph's smallest batch, or None: larger batches run eagerly. Never at or
        # under MAX_ROWS, where the eager product streams its weight (layers/gemv.py) and the
        # dynamic graph, one kernel for all its rows, would not: a batch between a last bucket
        # under 8 and 9 runs eagerly
        self.dynamic_from = max(buckets[-1], MAX_ROWS) + 1 if large == "dynamic" else None
        self.any_key = f"{self.dynamic_from}+"     # the dynamic graph's name in ``compile_s``
        self.progress = progress if progress is not None else _stderr
        self.cache = use_disk_cache()
        # each bucket is a shape of one function: dynamo's default allows 8 before it gives up
        # (set again in ``call``: dynamo's settings are each thread's own)
        self.recompile_limit = len(buckets) + 2
        self._limit_set = threading.local()      # on this thread already: no config read a step
        # the C++ backend's attention operator where it serves these pools (ops.py)
        self.native = isinstance(backend, CppAttention) and backend.serves_step(self.pool.caches)
        self.graph = with_own_code(DecodeGraph(self.net, self.native))
        # No ``freezing`` (weights as constants, fp32 ones packed for oneDNN): measured side by
        # side it bought nothing at one row (9.6 vs 9.3 tok/s, SmolLM2, docs/rungs/14_compiled.md)
        # while it made inductor skip its on-disk graph cache -- a second process compiled again
        # for minutes instead of loading the graph in seconds.
        # Guards: before each call dynamo checks that what it traced still holds. On the graph's
        # ~300 buffers (types, shapes, dtypes) that was 0.8 ms a step, 89 us with only the
        # inputs' guards (their shapes pick the bucket's graph; measured, docs/rungs/
        # 14_compiled.md). The runner never swaps its weights, and ``with_own_code`` keeps
        # another engine's graphs apart.
        # Size asserts: inductor's Python wrapper checks the shape and strides of every input and
        # of each operator's output before using it, ~20 calls a layer; our operators' shapes are
        # tested (tests/layers), and without the checks a one-row SmolLM2 step in w8a8 went from
        # 92 to 107 tok/s (docs/rungs/14_compiled.md).
        # The wrapper (``compile_wrapper``): inductor's generated Python calls each kernel and
        # operator of the step in turn, ~150 calls at one row; its C++ wrapper makes the same
        # calls with no interpreter between them (CompileConfig says what each costs).
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                   "size_asserts": False, "alignment_asserts": False,
                   "cpp_wrapper": wrapper == "cpp"}
        self.compiled = torch.compile(self.graph, dynamic=False, fullgraph=True, options=options)
        # The large batches' graph: the same module behind a code object of its own (a cache
        # and guards apart from the buckets'), compiled with the batch dimension marked dynamic
        # on its inputs (``call``): inductor's loops take the row count as an argument.
        self.compiled_any = torch.compile(with_own_code(AnyBatch(self.graph)), dynamic=None,
                                          fullgraph=True, options=options)
        self.compile_s: dict[int | str, float] = {}   # graph -> seconds its first call took
        self.steps = {"compiled": 0, "eager": 0}

    def compilable(self, scheduled) -> bool:
        """A step of one-token decodes with no guesses and no prompt logprobs, that fits a
        bucket or the dynamic graph: what a compiled graph computes."""
        rows = len(scheduled)
        return (0 < rows and (rows <= self.buckets[-1]
                              or (self.dynamic_from is not None and rows >= self.dynamic_from))
                and all(n == 1 and not s.spec_token_ids and s.request.prompt_logprobs is None
                        for s, n in scheduled))

    @torch.inference_mode()
    def run(self, scheduled):
        if not self.compilable(scheduled):
            self.steps["eager"] += 1
            return super().run(scheduled)
        self.steps["compiled"] += 1
        ids, pos, meta, order, _ = self.prepare(scheduled)
        rows = len(order)
        bucket = bucket_for(rows, self.buckets)
        if bucket is not None and bucket > rows:
            ids = torch.cat([ids, ids.new_zeros(bucket - rows)])
            pos = torch.cat([pos, pos.new_zeros(bucket - rows)])
        ctx = self.context(rows, meta.slot_mapping, meta.decode_block_tables,
                           meta.decode_context_lens)
        logits = self.call(bucket, ids, pos, ctx)
        return [s for s, _ in order], logits[:rows], []

    def context(self, rows: int, slots, block_tables, context_lens) -> StepContext:
        return StepContext(rows, self.pool.caches, self.backend, slots, block_tables,
                           context_lens, self.net.scale, self.graph.linears, self.native,
                           self.graph.linear_table)

    def call(self, bucket: int | None, ids, pos, ctx: StepContext) -> torch.Tensor:
        """The compiled step on ``bucket`` rows, or on the dynamic graph (``bucket`` None: any
        batch from ``dynamic_from`` rows); the first call of a graph compiles it."""
        if not getattr(self._limit_set, "done", False):
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, self.recompile_limit)
            self._limit_set.done = True
        graph, key = self.compiled, bucket
        if bucket is None:
            # the row count a symbol of the graph in [dynamic_from, ANY_BATCH_MAX]: a guard no
            # real batch fails (dynamo needs both ends of the range)
            for t in (ids, pos):
                torch._dynamo.mark_dynamic(t, 0, min=self.dynamic_from, max=ANY_BATCH_MAX)
            graph, key = self.compiled_any, self.any_key
        first = key not in self.compile_s
        if first:
            self.progress(f"compiling the decode step for batch {key} (buckets "
                          f"{','.join(map(str, self.buckets))}"
                          f"{'' if self.dynamic_from is None else ', then any batch'}; "
                          f"{self.wrapper} wrapper; cache {self.cache}) ...")
            start = time.perf_counter()
        with step_context(ctx):
            logits = graph(ids, pos)
        if first:
            self.compile_s[key] = time.perf_counter() - start
            self.progress(f"compiled batch {key} in {self.compile_s[key]:.1f} s")
        return logits

    @torch.inference_mode()
    def warm_up(self, max_rows: int) -> list[int | str]:
        """Compile every graph a batch of at most ``max_rows`` rows can meet now (the buckets the
        scheduler can fill, and the dynamic graph where it can pass the last bucket), so that no
        request waits for a compile: a server's first requests otherwise waited 11 s at P99 for
        the buckets a growing batch met one by one (docs/rungs/14_compiled.md). Each graph runs
        once on dummy rows: token 0 at position 0, all writing their K/V to slot 0 and reading
        that one slot. No request holds a block yet, and a request writes a slot before it reads
        it. Returns the graphs compiled (their ``compile_s`` keys)."""
        graphs = [b for b in self.buckets if b <= max_rows]
        if self.dynamic_from is not None and max_rows >= self.dynamic_from:
            graphs.append(None)
        done = []
        for bucket in graphs:
            rows, key = bucket or self.dynamic_from, bucket or self.any_key
            if key in self.compile_s:
                continue
            # three tensors, not one: a graph traced with ids and pos the same tensor is guarded
            # on that, and a real step (two tensors) compiled the bucket again
            ids, pos, slots = (torch.zeros(rows, dtype=torch.long, device=self.device)
                               for _ in range(3))
            ctx = self.context(rows, slots,
                               torch.zeros(rows, 1, dtype=torch.int32, device=self.device),
                               torch.ones(rows, dtype=torch.int32, device=self.device))
            self.call(bucket, ids, pos, ctx)
            done.append(key)
        return done

    def describe(self) -> dict:
        return {"compile_buckets": ",".join(map(str, self.buckets)),
                "compile_large_batches": "eager" if self.dynamic_from is None else "dynamic",
                "compile_wrapper": self.wrapper, "linear_kernel": self.net.linear_kernel.name,
                "compile_s": {b: round(s, 2) for b, s in self.compile_s.items()},
                "compiled_steps": self.steps["compiled"], "eager_steps": self.steps["eager"]}


class AnyBatch(nn.Module):
    """``graph`` again, as a module of its own for ``with_own_code``: the dynamic graph's code."""

    def __init__(self, graph: nn.Module):
        super().__init__()
        self.graph = graph

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.graph(ids, positions)


def with_own_code(module: nn.Module) -> nn.Module:
    """``module`` with a ``forward`` of its own code object. dynamo keeps compiled graphs and
    their guards per code object; with the module guards skipped, a second engine's graph of the
    same class would be taken for the first's (it was: a bf16 engine ran an fp32 engine's graph
    in one process). A copy of the code is a cache of its own, and a recompile limit of its own."""
    f = type(module).forward
    code = f.__code__.replace()         # equal, not the same object
    own = types.FunctionType(code, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    module.forward = types.MethodType(own, module)
    return module


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = ["ANY_BATCH_MAX", "AnyBatch", "CompiledRunner", "use_disk_cache", "with_own_code"]
