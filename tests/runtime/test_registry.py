"""One engine registry: names, options (from the constructors) and capabilities in one place."""
from __future__ import annotations

import subprocess
import sys

import pytest

from minillm import LLM, FinishReason, SamplingParams
from minillm.__main__ import build_parser, option_help
from conftest import engine_params
from minillm.engines import ENGINES, REGISTRY, all_options, create_engine, options_for


def test_every_option_has_a_flag_with_help():
    assert set(option_help()) == set(all_options())
    flags = build_parser().parse_args(["generate", "--prompts", "x", "--out", "y",
                                        "--block-size", "4", "--enable-prefix-caching"])
    assert flags.block_size == 4 and flags.enable_prefix_caching is True


def test_options_come_from_constructors(tiny):
    assert list(REGISTRY["static"].options) == ["batch_size"]
    assert "attention_backend" in REGISTRY["paged"].options
    assert options_for("dynamic", {"max_num_seqs": 3, "block_size": 4}) == {"max_num_seqs": 3}
    with pytest.raises(ValueError, match="bad option for engine 'dynamic': block_size"):
        create_engine("dynamic", tiny, block_size=4)
    with pytest.raises(ValueError, match="bad option for engine 'naive'.*no options"):
        create_engine("naive", tiny, runner=None)


@pytest.mark.parametrize("name", engine_params(ENGINES))
def test_capabilities_decide_what_is_served(tiny, name):
    spec = REGISTRY[name]
    out = LLM(tiny, engine=name).generate([[5, 6, 7]], SamplingParams(n=2, temperature=1, seed=0,
                                                                      max_tokens=2))[0]
    if spec.supports_parallel:
        assert out.finish_reason == FinishReason.LENGTH and len(out.samples) == 2
    else:
        assert out.finish_reason == FinishReason.ERROR and "'paged' engine" in out.error
    engine = create_engine(name, tiny)
    if not spec.supports_abort:
        with pytest.raises(NotImplementedError):
            engine.abort("x")
    else:
        assert engine.abort("x") is False


def test_no_import_cycle_between_cli_and_bench():
    code = "import sys, minillm.bench.offline; assert 'minillm.__main__' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_step_3_does_not_import_step_4():
    code = ("import sys, minillm.core.engine; "
            "assert not any(m == 'minillm.layers.attention.triton' or "
            "m.startswith('minillm.layers.attention.triton.') for m in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def module_imports() -> dict[str, set[str]]:
    """minillm module -> the minillm modules it imports when it is loaded (imports inside
    functions and under ``TYPE_CHECKING`` run later, so they cannot form a cycle)."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    graph: dict[str, set[str]] = {}
    for path in (root / "minillm").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        package = name if is_pkg else name.rpartition(".")[0]
        deps = graph.setdefault(name, set())
        for node in ast.parse(path.read_text()).body:      # module level only
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                deps.add(mod)
                deps.update(f"{mod}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
    return {k: {d for d in v if d in graph and d != k} for k, v in graph.items()}


def test_no_import_cycle_in_the_package():
    graph = module_imports()
    assert "minillm.engines.r5_allocators" in graph["minillm.viz.replay"]          # the graph is read
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [])
