"""Engine options are fields of frozen config dataclasses: checked once when made, never changed
afterwards, and the one source of the registry's options and of the CLI's flags and help."""
from __future__ import annotations

import dataclasses

import pytest

from minillm.__main__ import build_parser, option_help
from minillm.runtime.config import options_of
from minillm.layers.config import ModelConfig
from minillm.core.config import CacheConfig, SchedulerConfig
from minillm.engines.r8_policies.config import PolicyConfig
from minillm.engines import ENGINES, REGISTRY, all_options, create_engine, resolve
from minillm.engines.r1_static import StaticConfig
from minillm.engines.r2_dynamic import DynamicBatchEngine, DynamicConfig
from minillm.engines.r6_speculative import SpeculativeConfig
from minillm.engines.r7_pipeline.config import ParallelConfig

CONFIGS = (CacheConfig, SchedulerConfig, ModelConfig, StaticConfig, DynamicConfig,
           SpeculativeConfig, ParallelConfig)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_configs_are_frozen(config):
    cfg = config()
    field = dataclasses.fields(config)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, field.name, getattr(cfg, field.name))


@pytest.mark.parametrize("config,kwargs,words", [
    (CacheConfig, {"block_size": 0}, "block_size must be an integer >= 1, got 0"),
    (CacheConfig, {"num_blocks": 2.5}, "num_blocks must be an integer, got 2.5"),
    (CacheConfig, {"enable_prefix_caching": 1}, "enable_prefix_caching must be True or False, got 1"),
    (PolicyConfig, {"policy": "lifo"}, "unknown policy 'lifo': choose one of fcfs, priority, score"),
    (SchedulerConfig, {"max_num_seqs": -3}, "max_num_seqs must be an integer >= 1, got -3"),
    (ModelConfig, {"attention_backend": "cuda"}, "unknown attention_backend 'cuda'"),
    (StaticConfig, {"batch_size": "8"}, "batch_size must be an integer, got '8'"),
    (DynamicConfig, {"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
    (ParallelConfig, {"pipeline_parallel_size": 1}, "pipeline_parallel_size must be an integer >= 2, got 1"),
    (ParallelConfig, {"num_microbatches": 0}, "num_microbatches must be an integer >= 1, got 0"),
    (ParallelConfig, {"pipeline_timeout_s": None}, "pipeline_timeout_s must be an integer, got None"),
])
def test_an_invalid_value_names_the_field_and_the_value(config, kwargs, words):
    with pytest.raises(ValueError, match=words):
        config(**kwargs)


def test_integer_like_values_are_stored_as_plain_ints():
    import numpy as np
    cfg = CacheConfig(block_size=np.int64(8), num_blocks=np.int32(4))
    assert type(cfg.block_size) is int and type(cfg.num_blocks) is int
    assert (cfg.block_size, cfg.num_blocks) == (8, 4)


def test_pool_too_small_for_one_block():
    with pytest.raises(ValueError, match=r"kv_cache_bytes=10 is smaller than one block \(64 bytes\)"):
        CacheConfig(block_size=4, kv_cache_bytes=10).num_blocks_for(16, 128, 8)
    assert CacheConfig(block_size=4, kv_cache_bytes=640).num_blocks_for(16, 128, 8) == 10
    assert CacheConfig(block_size=4).num_blocks_for(16, 128, 8) == 8 * 32   # capped by full length


@pytest.mark.parametrize("name", ENGINES)
def test_registry_options_are_the_config_fields_minus_the_fixed_ones(name):
    spec = REGISTRY[name]
    fields = [f.metadata.get("option") or f.name
              for config in spec.load().configs + spec.feature_configs()
              for f in dataclasses.fields(config)]
    assert list(spec.options) == [f for f in fields if f not in spec.fixed]


def test_every_flag_and_its_help_come_from_field_metadata():
    assert set(option_help()) == set(all_options())
    for spec in REGISTRY.values():
        for config in spec.load().configs:
            for name, opt in options_of(config).items():
                field = next(f for f in dataclasses.fields(config) if f.name == opt.field)
                assert field.metadata["help"] and field.metadata["help"] in option_help()[name]
    args = build_parser().parse_args(["generate", "--prompts", "x", "--out", "y", "--attention",
                                      "torch", "--pipeline-parallel", "3", "--speculative", "draft"])
    assert (args.attention_backend, args.pipeline_parallel_size, args.speculative) == \
        ("torch", 3, "draft")
    # one flag shared by two engines keeps both engines' help
    assert "dynamic:" in option_help()["max_num_seqs"] and "paged:" in option_help()["max_num_seqs"]


def test_routing_lives_in_the_registry():
    spec, options, fixed = resolve("paged", {"speculative": "draft", "block_size": 4})
    assert (spec.name, options, fixed) == ("paged+draft", {"block_size": 4}, {"speculative": "draft"})
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=2)
    spec, _, fixed = resolve("paged", {"speculative": cfg})
    assert spec.name == "paged+ngram" and fixed["speculative"] is cfg
    spec, options, _ = resolve("paged", {"pipeline_parallel_size": 3})
    assert spec.name == "pipeline" and options == {"pipeline_parallel_size": 3}
    assert resolve("paged", {"speculative": None})[:2] == (REGISTRY["paged"], {})
    assert resolve("static", {"batch_size": 2})[0].name == "static"
    with pytest.raises(ValueError, match="speculative must be 'ngram' or 'draft' "
                                         r"\(or a SpeculativeConfig\), got 'eagle'"):
        resolve("paged", {"speculative": "eagle"})
    with pytest.raises(ValueError, match="unknown engine 'warp'"):
        resolve("warp", {})
    assert REGISTRY["pipeline"].load_worker().__name__ == "torchrun_worker"
    assert REGISTRY["naive"].serves_one_at_a_time and not REGISTRY["static"].serves_one_at_a_time


def test_serve_offers_the_servable_engines_that_abort():
    from minillm.serve.cli import servable_engines
    assert servable_engines()[:4] == ("dynamic", "paged", "disagg", "paged-async")   # rung 12
    assert all(REGISTRY[name].supports_abort for name in servable_engines())


def test_engines_keep_their_configs(tiny):
    engine = create_engine("paged", tiny, block_size=4, num_blocks=8, policy="priority",
                           attention_backend="torch")
    assert engine.cache_config == CacheConfig(block_size=4, num_blocks=8)
    assert engine.scheduler.policy.name == "priority"          # a component, from rung 8's option
    assert engine.block_size == 4 and engine.block_manager.num_blocks == 8
    assert engine.model_config.attention_backend == "torch" and engine.backend.name == "torch"
    dynamic = DynamicBatchEngine(tiny, max_num_seqs=3)
    assert dynamic.dynamic_config == DynamicConfig(3) and dynamic.max_num_seqs == 3
    with pytest.raises(TypeError, match="DynamicBatchEngine.*'block_size'"):
        DynamicBatchEngine(tiny, block_size=4)
    spec = create_engine("paged", tiny, speculative="ngram", num_speculative_tokens=3,
                         num_blocks=8, attention_backend="torch")
    assert spec.name == "paged+ngram" and spec.speculative_config.num_speculative_tokens == 3
    assert spec.cache_config.num_blocks == 8
