"""Engine configuration: frozen dataclasses, one per concern, in vLLM's vocabulary
(``CacheConfig``, ``SchedulerConfig``, ``ModelConfig``; rungs add theirs: ``StaticConfig``,
``DynamicConfig``, ``SpeculativeConfig``, ``ParallelConfig``).

Every field is an engine option. Its keyword (and the CLI's ``--flag``) is the field's name, or
``metadata["option"]``; its help and extra CLI flags live in the field's metadata too (``option``
below). An engine lists the configs it takes (``Engine.configs``); the registry, the CLI and
``LLM`` read every option from there, so no list of options is kept by hand. A config is checked
once, when it is made: a bad value is a ``ValueError`` naming the field and the value, and a
config that exists is valid (it cannot be changed afterwards).
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field

from ..checks import check_float, check_int
from .kv_quant import KV_CACHE_DTYPES
from .batch_controller import CONTROLLERS, OVERLOAD
from .policy import MAX_SCORE_WEIGHT, MAX_SLO_MS, POLICIES, check_slo_ms, parse_slo_classes

DEFAULT_KV_CACHE_BYTES = 1 << 30
# The smallest tpot_target_ms: no engine step takes less than 0.1 ms on any device (the
# scheduler's Python, a forward's kernel launches and sampling each take tens of microseconds or
# more), so a smaller target could never be met and the controller would hold the batch at one
# token forever.
MIN_TPOT_TARGET_MS = 0.1
ATTENTION_BACKENDS = ("torch", "cpp", "triton")
LINEAR_BACKENDS = ("torch", "onednn")
LAYER_OPS = ("fused", "eager")


def option(default, help: str, *, aliases: tuple[str, ...] = (), name: str | None = None):
    """A config field that is an engine option: ``help`` and ``aliases`` (extra CLI flags) are
    what the CLI shows; ``name``: the option's keyword when it is not the field's name."""
    return field(default=default, metadata={"help": help, "aliases": aliases, "option": name})


def set_checked(config, name: str, minimum: int | None = 1, optional: bool = False) -> None:
    """Replace ``config.name`` by ``check_int``'s plain int (a frozen dataclass is set once, in
    ``__post_init__``); None passes where the field is ``optional``."""
    value = getattr(config, name)
    if not (optional and value is None):
        object.__setattr__(config, name, check_int(name, value, minimum))


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


# --- rung 3's configs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheConfig:
    """The KV pool: its blocks, how many (notebook 03) and how wide each slot is (notebook 09)."""

    block_size: int = option(16, "paged: tokens per KV block")
    num_blocks: int | None = option(None, "paged: KV pool size in blocks")
    kv_cache_bytes: int | None = option(None, "paged: KV pool size in bytes (default 1 GiB)")
    enable_prefix_caching: bool = option(False, "paged: reuse KV blocks of shared prompt "
                                                "prefixes")
    kv_cache_dtype: str = option("auto", "paged: how KV is stored: auto (the model's dtype), "
                                         "float16, bfloat16, int8 or fp8 (core/kv_quant.py)")

    def __post_init__(self):
        set_checked(self, "block_size")
        set_checked(self, "num_blocks", optional=True)
        set_checked(self, "kv_cache_bytes", optional=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}: choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")

    def num_blocks_for(self, bytes_per_token: int, max_model_len: int, max_num_seqs: int) -> int:
        """Blocks in the pool: ``num_blocks``, or as many as ``kv_cache_bytes`` hold (default
        1 GiB, but no more than ``max_num_seqs`` sequences at full length could use)."""
        if self.num_blocks is not None:
            return self.num_blocks
        block_bytes = self.block_size * bytes_per_token
        if self.kv_cache_bytes is None:
            n = DEFAULT_KV_CACHE_BYTES // block_bytes
            return int(min(n, max_num_seqs * -(-max_model_len // self.block_size)))
        if self.kv_cache_bytes < block_bytes:
            raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} is smaller than one block "
                             f"({block_bytes} bytes)")
        return self.kv_cache_bytes // block_bytes


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold: the token budget, the running requests, who goes first."""

    max_num_batched_tokens: int = option(1024, "paged: token budget per step")
    max_num_seqs: int = option(64, "paged: max concurrent requests")
    policy: str = option("fcfs", f"paged: scheduling order ({', '.join(POLICIES)}; "
                                 "core/policy.py)")
    priority_preemption_threshold: int = option(
        0, "paged, policy=priority: a waiting request evicts a running one whose priority value "
           "is higher by more than this")
    score_wait_weight: float = option(1.0, "paged, policy=score: weight of each step waited")
    score_remaining_weight: float = option(
        0.1, "paged, policy=score: weight of each token still to generate")
    score_priority_weight: float = option(
        20.0, "paged, policy=score: weight of each unit of request priority (in steps of "
              "waiting; the starvation bound grows with it, core/policy.py)")
    score_margin: float = option(
        10.0, "paged, policy=score: a waiting request evicts a running one only if its score is "
              "lower by more than this")
    # rung 12 (notebook 12): deadlines, the adaptive batch, the overlapped step
    slo_ttft_ms: float = option(
        1000.0, "paged, policy=slo: the TTFT objective (ms) of a request that names none")
    slo_tpot_ms: float = option(
        100.0, "paged, policy=slo: the TPOT objective (ms) of a request that names none")
    slo_classes: str | None = option(
        None, "paged, policy=slo: objectives by request priority for requests that name none, "
              "'P:TTFT_MS:TPOT_MS,...' (or ';'; e.g. '0:1000:100,1:20000:500'); other "
              "priorities get slo_ttft_ms / slo_tpot_ms")
    slo_margin_ms: float = option(
        100.0, "paged, policy=slo: a request with no token yet evicts a running one only if its "
               "deadline is earlier by more than this (ms)")
    batch_controller: str = option(
        "none", "paged: none (fixed limits) or tpot (the token budget per step follows the "
                "measured step time to hold tpot_target_ms; core/batch_controller.py)")
    tpot_target_ms: float = option(
        100.0, "paged, batch_controller=tpot: the step time (= TPOT) to hold (ms)")
    tpot_overload: str = option(
        "hold", "paged, batch_controller=tpot: when arrivals bring more work than the target's "
                "batch serves: hold (keep the target; requests wait) or widen (the narrowest "
                "batch that keeps up; TPOT grows)")
    async_scheduling: bool = option(
        False, "paged: overlap the next step's forward with this step's outputs (rung 12)")

    def __post_init__(self):
        set_checked(self, "max_num_batched_tokens")
        set_checked(self, "max_num_seqs")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        set_checked(self, "priority_preemption_threshold", minimum=0)
        for name in ("score_wait_weight", "score_remaining_weight", "score_priority_weight",
                     "score_margin"):
            value = check_float(name, getattr(self, name))
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
            # bounded so that a score stays finite for any accepted request (core/policy.py)
            if name != "score_margin" and value > MAX_SCORE_WEIGHT:
                raise ValueError(f"{name} must be <= {MAX_SCORE_WEIGHT:g}, got {value!r}")
            object.__setattr__(self, name, value)
        for name in ("slo_ttft_ms", "slo_tpot_ms", "tpot_target_ms"):
            object.__setattr__(self, name, check_slo_ms(name, getattr(self, name)))
        if self.tpot_target_ms < MIN_TPOT_TARGET_MS:
            raise ValueError(f"tpot_target_ms must be >= {MIN_TPOT_TARGET_MS:g} ms (no step is "
                             f"faster), got {self.tpot_target_ms!r}")
        parse_slo_classes(self.slo_classes)          # a ValueError naming the bad item
        margin = check_float("slo_margin_ms", self.slo_margin_ms)
        if not 0 <= margin <= MAX_SLO_MS:
            raise ValueError(f"slo_margin_ms must be in [0, {MAX_SLO_MS:g}], got {margin!r}")
        object.__setattr__(self, "slo_margin_ms", margin)
        if self.batch_controller not in CONTROLLERS:
            raise ValueError(f"unknown batch_controller {self.batch_controller!r}: choose "
                             f"{' or '.join(map(repr, CONTROLLERS))}")
        if self.tpot_overload not in OVERLOAD:
            raise ValueError(f"unknown tpot_overload {self.tpot_overload!r}: choose "
                             f"{' or '.join(map(repr, OVERLOAD))}")
        check_bool("async_scheduling", self.async_scheduling)


@dataclass(frozen=True)
class ModelConfig:
    """How the model runs: the attention backend (rung 3's torch reference, rung 4's kernels) and
    the kernel of the linear layers (core/linear.py)."""

    attention_backend: str | None = option(
        None, "paged: attention backend, torch, cpp or triton (default: triton on CUDA, cpp on "
              "CPU where a C++ compiler builds it, else torch)", aliases=("--attention",))
    linear_backend: str | None = option(
        None, "paged: linear-layer kernel, torch (F.linear) or onednn (weights reordered once; "
              "default for fp32 on the CPU where it works, else torch)")
    layer_ops: str | None = option(
        None, "paged: a layer's RMSNorm, RoPE and SiLU, fused (one C++ pass each: the default for "
              "fp32/bf16/fp16 on the CPU where it builds) or eager (torch ops: the reference)")

    def __post_init__(self):
        if self.layer_ops not in (None, *LAYER_OPS):
            raise ValueError(f"unknown layer_ops {self.layer_ops!r}: choose "
                             f"{' or '.join(map(repr, LAYER_OPS))}")
        if self.linear_backend not in (None, *LINEAR_BACKENDS):
            raise ValueError(f"unknown linear_backend {self.linear_backend!r}: choose "
                             f"{' or '.join(map(repr, LINEAR_BACKENDS))}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}: choose "
                             f"{', '.join(map(repr, ATTENTION_BACKENDS[:-1]))} or "
                             f"{ATTENTION_BACKENDS[-1]!r}")


# --- options: what the registry and the CLI read -----------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One engine option: a field of a config class."""

    name: str                  # its keyword, and ``--name-with-dashes`` on the command line
    config: type               # the config class that holds it
    field: str                 # the field it sets
    default: object
    type: type                 # what the CLI parses: int, str or bool
    help: str
    aliases: tuple[str, ...] = ()

    @property
    def flags(self) -> list[str]:
        return ["--" + self.name.replace("_", "-"), *self.aliases]


def _scalar(hint) -> type:
    """``int`` for ``int | None``: the type a flag's text is parsed into."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def options_of(config: type) -> dict[str, Option]:
    """The options of one config class, by keyword, in field order."""
    hints = typing.get_type_hints(config)
    out = {}
    for f in dataclasses.fields(config):
        name = f.metadata.get("option") or f.name
        out[name] = Option(name, config, f.name, f.default, _scalar(hints[f.name]),
                           f.metadata["help"], f.metadata.get("aliases", ()))
    return out


def option_value(value, name: str):
    """What option ``name`` says: ``value`` itself, or, for a whole config passed under the name
    of one of its fields (``speculative=SpeculativeConfig(...)``), that field's value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        opt = options_of(type(value)).get(name)
        return value if opt is None else getattr(value, opt.field)
    return value


def config_attr(config: type) -> str:
    """The engine attribute a config is kept in: ``CacheConfig`` -> ``cache_config``. A config
    that refines another (rung 10's ``TensorParallelConfig`` of rung 7's ``ParallelConfig``) is
    kept under the other's name: the code that reads it is the same, no alias needed. A word
    ends before a capital that starts a lowercase run, so an acronym stays one word (rung 13's
    ``LoRAConfig`` -> ``lora_config``)."""
    root = [c for c in config.__mro__ if dataclasses.is_dataclass(c)][-1]
    return re.sub(r"(?<=[A-Za-z0-9])(?=[A-Z][a-z])", "_", root.__name__).lower()


def build_configs(configs: tuple[type, ...], options: dict, owner: str) -> list:
    """One instance of each class of ``configs``, made from flat ``options`` (keyword -> value).
    A whole config may be passed under the keyword of one of its fields; it then wins over the
    options of its class beside it. An unknown keyword is a TypeError, as for any call."""
    known = {name: cfg for cfg in configs for name in options_of(cfg)}
    unknown = [k for k in options if k not in known]
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    out = []
    for cfg in configs:
        mine = {o.field: options[name] for name, o in options_of(cfg).items() if name in options}
        whole = [v for v in mine.values() if isinstance(v, cfg)]
        out.append(whole[0] if whole else cfg(**mine))
    return out


__all__ = ["ATTENTION_BACKENDS", "CacheConfig", "DEFAULT_KV_CACHE_BYTES", "LINEAR_BACKENDS",
           "ModelConfig", "Option",
           "POLICIES", "SchedulerConfig", "build_configs", "config_attr", "option", "option_value",
           "options_of"]
