"""The ladder: one module per rung, all behind the ``Engine`` interface of ``base.py``.

``REGISTRY`` is the one list of engines: name -> class, the options it takes (the fields of the
config dataclasses the class declares in ``configs``, ``minillm/core/config.py``: no list of
options is kept by hand anywhere), where a name leads with some options (``upgrades``: ``paged``
with ``speculative=`` is rung 6, with ``pipeline_parallel_size`` rung 7, with
``tensor_parallel_size`` rung 10, with ``enable_lora`` rung 13; ``disagg``, rung 11, has a name
of its own) and what it can do
(abort, n > 1 and beam search: class attributes of the engine). The CLI, the benchmark, the
server and ``LLM`` all go through it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Callable

from ..core.attention import get_attention_backend
from ..core.config import Option, option_value, options_of
from ..core.driver import RunResult
from ..core.interface import Engine, StepOutput


@dataclass(frozen=True)
class EngineSpec:
    name: str
    rung: int                         # its place on the ladder = its notebook's number
    module: str                       # the module that defines ``cls``
    cls: str
    fixed: dict = field(default_factory=dict)   # what the name implies (naive-nocache: no cache)
    # option -> the engine this one becomes when it is set: an engine name, or one per value
    upgrades: dict[str, str | dict[str, str]] = field(default_factory=dict)
    worker: str | None = None         # "module:function" ranks 1.. run under torchrun
    servable: bool = False            # ``python -m minillm serve`` offers it

    def load(self) -> type[Engine]:
        return getattr(importlib.import_module(self.module), self.cls)

    @property
    def fields(self) -> dict[str, Option]:
        """Every field of the engine's configs, as an option (``fixed`` ones included)."""
        return {k: o for config in self.load().configs for k, o in options_of(config).items()}

    @property
    def options(self) -> dict[str, Option]:
        """The options a user may pass, by name: the config fields the name does not fix."""
        return {k: o for k, o in self.fields.items() if k not in self.fixed}

    @property
    def supports_abort(self) -> bool:
        return self.load().supports_abort

    @property
    def supports_parallel(self) -> bool:
        """n > 1 parallel samples and beam search (they need blocks that can be shared)."""
        return self.load().supports_parallel

    @property
    def serves_one_at_a_time(self) -> bool:
        return self.load().serves_one_at_a_time

    def load_worker(self) -> Callable[..., int]:
        """The worker function (model name, **options) -> exit status."""
        module, function = self.worker.split(":")
        return getattr(importlib.import_module(module), function)


_SPEC = "minillm.engines.r6_speculative.engine"
REGISTRY: dict[str, EngineSpec] = {s.name: s for s in (
    EngineSpec("naive-nocache", 0, "minillm.engines.r0_naive", "NaiveEngine", {"use_cache": False}),
    EngineSpec("naive", 0, "minillm.engines.r0_naive", "NaiveEngine", {"use_cache": True}),
    EngineSpec("static", 1, "minillm.engines.r1_static", "StaticBatchEngine"),
    EngineSpec("dynamic", 2, "minillm.engines.r2_dynamic", "DynamicBatchEngine", servable=True),
    EngineSpec("paged", 3, "minillm.core.engine", "PagedEngine", servable=True, upgrades={
        "speculative": {"ngram": "paged+ngram", "draft": "paged+draft"},
        "tensor_parallel_size": "tensor", "pipeline_parallel_size": "pipeline",
        "async_scheduling": {True: "paged-async", False: "paged"},
        "enable_lora": {True: "paged+lora"}}),
    EngineSpec("paged+ngram", 6, _SPEC, "SpeculativeEngine", {"speculative": "ngram"},
               upgrades={"async_scheduling": {True: "paged+ngram-async", False: "paged+ngram"}}),
    EngineSpec("paged+draft", 6, _SPEC, "SpeculativeEngine", {"speculative": "draft"},
               upgrades={"async_scheduling": {True: "paged+draft-async", False: "paged+draft"}}),
    EngineSpec("pipeline", 7, "minillm.engines.r7_pipeline.engine", "PipelineEngine",
               upgrades={"tensor_parallel_size": "tensor"},
               worker="minillm.engines.r7_pipeline.launcher:torchrun_worker"),
    EngineSpec("tensor", 10, "minillm.engines.r10_tensor.engine", "TensorParallelEngine",
               worker="minillm.engines.r10_tensor.engine:torchrun_worker"),
    EngineSpec("disagg", 11, "minillm.engines.r11_disagg.engine", "DisaggEngine", servable=True),
    EngineSpec("paged-async", 12, "minillm.engines.r12_realtime.engine", "AsyncEngine",
               {"async_scheduling": True}, servable=True),
    EngineSpec("paged+ngram-async", 12, "minillm.engines.r12_realtime.engine",
               "AsyncSpeculativeEngine", {"speculative": "ngram", "async_scheduling": True}),
    EngineSpec("paged+draft-async", 12, "minillm.engines.r12_realtime.engine",
               "AsyncSpeculativeEngine", {"speculative": "draft", "async_scheduling": True}),
    EngineSpec("paged+lora", 13, "minillm.engines.r13_lora.engine", "LoRAEngine",
               {"enable_lora": True}, servable=True),
)}
ENGINES = tuple(REGISTRY)


def resolve(name: str, options: dict) -> tuple[EngineSpec, dict, dict]:
    """The engine ``name`` with ``options`` builds: (its spec, the options left for it, the
    values its name fixes). An upgrade option moves ``name`` on (``paged`` + ``speculative="ngram"``
    or a ``SpeculativeConfig`` is ``paged+ngram``); one set to None is dropped."""
    spec = REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
    options = dict(options)
    for option, to in spec.upgrades.items():
        if option in options and options[option] is None:
            del options[option]
        if option not in options:
            continue
        if isinstance(to, str):
            return resolve(to, options)
        value = options.pop(option)
        target = next((e for key, e in to.items() if key == option_value(value, option)), None)
        if target is None:
            config = all_options()[option].config.__name__
            raise ValueError(f"{option} must be {' or '.join(map(repr, to))} (or a {config}), "
                             f"got {value!r}")
        spec, options, fixed = resolve(target, options)    # it may move on (speculative, async)
        return spec, options, {**fixed, option: value}
    return spec, options, dict(spec.fixed)


def create_engine(name: str, model, **options) -> Engine:
    """Build engine ``name`` (or the one it ``resolve``s to) for a loaded model; ``options``
    are its configs' fields, flat."""
    spec, options, fixed = resolve(name, options)
    allowed = spec.options
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"bad option for engine {spec.name!r}: {', '.join(unknown)} (it takes "
                         f"{', '.join(allowed) or 'no options'})")
    return spec.load()(model, **fixed, **options)


def all_options() -> dict[str, Option]:
    """Every option any engine takes, in ladder order (the CLI makes a flag of each). An option
    two engines share with different help (``max_num_seqs``) gets both."""
    out: dict[str, Option] = {}
    for spec in REGISTRY.values():
        for name, opt in spec.fields.items():
            if name not in out:
                out[name] = opt
            elif opt.help not in out[name].help:
                out[name] = replace(out[name], help=f"{out[name].help}; {opt.help}")
    return out


def options_from(namespace) -> dict:
    """The engine options set on an argparse namespace (flags left unset are omitted)."""
    return {k: getattr(namespace, k) for k in all_options() if getattr(namespace, k, None) is not None}


def options_for(name: str, options: dict) -> dict:
    """The subset of ``options`` that engine ``name`` takes (the benchmark passes one set of
    options to every engine)."""
    allowed = REGISTRY[name].options
    return {k: v for k, v in options.items() if k in allowed}


__all__ = ["ENGINES", "REGISTRY", "Engine", "EngineSpec", "RunResult", "StepOutput",
           "all_options", "create_engine", "get_attention_backend", "options_for", "options_from",
           "resolve"]
