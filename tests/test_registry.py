"""One engine registry: names, options (from the constructors) and capabilities in one place."""
from __future__ import annotations

import subprocess
import sys

import pytest

from minillm import LLM, FinishReason, SamplingParams
from minillm.__main__ import OPTION_HELP, build_parser
from minillm.engines import ENGINES, REGISTRY, all_options, create_engine, options_for


def test_every_option_has_a_flag_with_help():
    assert set(OPTION_HELP) == set(all_options())
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


@pytest.mark.parametrize("name", ENGINES)
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
    code = "import sys, minillm.bench; assert 'minillm.__main__' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_step_3_does_not_import_step_4():
    code = ("import sys, minillm.engines.s3_paged.engine; "
            "assert not any(m.startswith('minillm.engines.s4_triton') for m in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
