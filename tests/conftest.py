"""Shared fixtures: the tiny random Llama for most tests, the real SmolLM2 where realism matters,
and the Hugging Face reference every engine is checked against."""
from __future__ import annotations

import gc
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from minillm import load_model
from minillm.lab.reference import Reference, assert_greedy_match, hf_greedy, random_prompts  # noqa: F401

# Tests live by subsystem (tests/runtime, layers, core, rungs, serve, viz, lab, bench, meta); their
# basenames are unique, so a test may import another's helpers by name from any folder (the
# serving LoRA test takes rung 13's adapters), whichever file pytest was asked to run.
sys.path[1:1] = sorted(str(d) for d in Path(__file__).parent.iterdir()
                       if d.is_dir() and not d.name.startswith(("_", ".")))

# Two xdist workers on two cores (`make test` runs `-n 2`): one torch thread each, and the same
# for the processes a test starts (graders, servers, workers). Two OpenMP teams of two on two
# cores wait on each other's cores (the README's "shared machine" note: 7-12x slower per token).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)

# Ctrl-C as in a terminal even when the suite runs as a background job (`make test &`, nohup):
# a shell starts those with SIGINT ignored, every process below inherits it, and the tests that
# send themselves (or a server they start) a real SIGINT would see nothing happen.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _resident_bytes() -> int:
    """This process's resident memory now (Linux; 0 elsewhere, where nothing below runs)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@pytest.fixture(autouse=True, scope="module")
def _free_engines_left_in_cycles():
    """After each test file, a process holding over 3 GB collects its garbage. Engines do not
    sit in reference cycles (test_observe.py checks it), but a test can still leave a big object in
    one (a traceback keeping frames, a fixture's closure), and a cycle lives until a full
    collection, which a big heap rarely runs. With engines in cycles, the two workers of
    `make test` grow to 5-6 GB each, and with a notebook's kernel beside them a 24 GB machine
    runs out. A collection costs ~0.25 s, so only a process that holds that much pays."""
    yield
    if _resident_bytes() > 3 * 2**30:
        gc.collect()


def pytest_collection_modifyitems(items):
    """A test that loads the real SmolLM2 (the ``smol`` fixture) is slow by definition (the
    marker's meaning in pyproject.toml): ``make test-fast`` runs the tiny random model only."""
    for item in items:
        if "smol" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny():
    # fp32 on every device (CUDA would default to bf16): the near-tie tolerance of
    # ``assert_greedy_match`` and the token-equality tests assume fp32 rounding.
    return load_model("tiny-llama", dtype=torch.float32)


@pytest.fixture(scope="session")
def smol():
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hf_ref():
    """``hf_greedy`` computed once per test process for each (model, prompt, length): the
    engines and KV formats that a test is parametrized over are compared with the same HF run,
    not one each (SmolLM2's 24-32 tokens take ~1 s per prompt)."""
    cache: dict = {}

    def ref(model, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False):
        key = (id(model), tuple(prompt_ids), max_new_tokens, stop_at_eos)
        if key not in cache:       # the model is kept with its answer: its id is not reused
            cache[key] = (model, hf_greedy(model, list(prompt_ids), max_new_tokens, stop_at_eos))
        return cache[key][1]
    return ref


def engine_params(names) -> list:
    """Engine names as test parameters; the engines that start worker processes (pipeline,
    tensor, disagg) are marked slow: ``make test-fast`` runs no multi-process test."""
    from minillm.engines import REGISTRY
    multi = {n for n, s in REGISTRY.items() if s.worker is not None} | {"disagg"}
    return [pytest.param(n, marks=pytest.mark.slow) if n in multi else n for n in names]


def drain(engine, finals: Counter | None = None, max_steps: int = 10_000) -> Counter:
    """Step ``engine`` until it has nothing left, counting each finished request in ``finals``;
    a bound on the steps turns a hang into a failure."""
    finals = Counter() if finals is None else finals
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return finals
        for req in engine.step().finished:
            finals[req.request_id] += 1
    state = ""
    if hasattr(engine, "scheduler"):
        state = (f": waiting {len(engine.scheduler.waiting)}, running "
                 f"{len(engine.scheduler.running)}, free blocks "
                 f"{engine.block_manager.num_free_blocks}")
    raise AssertionError(f"engine never drained: no end after {max_steps} steps{state}")


def graph_ops(module, *inputs) -> set[str]:
    """The operators in the graph ``torch.compile`` traces for ``module(*inputs)`` (rung 14)."""
    seen: set[str] = set()

    def record(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=record, fullgraph=True)(*inputs)
    return seen
