"""The ladder: one module per rung, all behind the ``Engine`` interface of ``runtime/``.

``REGISTRY`` is the one list of engines: name -> class, the options it takes (the fields of the
config dataclasses the class declares in ``configs``: no list of options is kept by hand
anywhere), where a name leads with some options (``upgrades``: ``paged`` with ``speculative=`` is
rung 6, with ``pipeline_parallel_size`` rung 7, with ``tensor_parallel_size`` rung 10, with
``enable_lora`` rung 13, with ``compile`` rung 14; ``disagg``, rung 11, has a name of its own),
the rungs' configs that plug a component into it (``features``: rung 12's ``async_scheduling``
is an executor, on ``paged`` and rung 6 alike; an engine without the feature refuses the option
by name) and what it can do (abort, n > 1 and beam search: class attributes of the engine). The
CLI, the benchmark, the server and ``LLM`` all go through it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Callable

from ..layers.attention import get_attention_backend
from ..runtime.config import Option, build_configs, config_attr, option_value, options_of
from ..runtime.driver import RunResult
from ..runtime.heap import trim
from ..runtime.interface import Engine, StepOutput


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
    # "module:Config" of the rungs' configs that plug a component into this engine: each has
    # ``components() -> {keyword: component}`` (rung 12's AsyncConfig: executor=ThreadExecutor())
    features: tuple[str, ...] = ()

    def load(self) -> type[Engine]:
        return getattr(importlib.import_module(self.module), self.cls)

    def feature_configs(self) -> tuple[type, ...]:
        return tuple(getattr(importlib.import_module(m), c)
                     for m, c in (f.split(":") for f in self.features))

    @property
    def fields(self) -> dict[str, Option]:
        """Every field of the engine's configs and its features', as an option (``fixed`` ones
        included)."""
        configs = self.load().configs + self.feature_configs()
        return {k: o for config in configs for k, o in options_of(config).items()}

    def components(self, options: dict) -> dict:
        """What this engine's features build from ``options``: each feature config's
        ``components(configs)``, which sees every config of the engine by attribute name."""
        cls, features = self.load(), self.feature_configs()
        known = {k: v for k, v in options.items() if k in self.fields}
        made = build_configs(cls.configs + features, known, self.name)
        configs = {"engine": self.name, **{config_attr(type(c)): c for c in made}}
        out: dict = {}
        for config in made[len(cls.configs):]:
            out.update(config.components(configs))
        return out

    def engine_kwargs(self, options: dict) -> dict:
        """The keyword arguments of this engine's class for ``options``: its own options, and
        for its features' options the components they build."""
        mine = {k for config in self.feature_configs() for k in options_of(config)}
        return {**{k: v for k, v in options.items() if k not in mine}, **self.components(options)}

    def build(self, model, options: dict) -> Engine:
        return self.load()(model, **self.engine_kwargs(options))

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


def build_components(options: dict, name: str = "paged") -> dict:
    """The components engine ``name``'s features build from ``options`` (``policy="score"``...)."""
    return REGISTRY[name].components(options)


def engine_kwargs(options: dict, name: str = "paged") -> dict:
    """``options`` as the keyword arguments of engine ``name``'s class, the features' options
    built into components: for code that makes a ``PagedEngine`` itself, with parts of its own
    (the visualizer's replays, rung 12's simulator, the graders)."""
    return REGISTRY[name].engine_kwargs(options)


_SPEC = "minillm.engines.r6_speculative.engine"
_POLICY = "minillm.engines.r8_policies.config:PolicyConfig"
_REALTIME = "minillm.engines.r12_realtime.config:RealtimeConfig"
_ASYNC = "minillm.engines.r12_realtime.config:AsyncConfig"
_PAGED = (_POLICY, _REALTIME, _ASYNC)    # what the paged engine takes, and rung 6 on it
REGISTRY: dict[str, EngineSpec] = {s.name: s for s in (
    EngineSpec("naive-nocache", 0, "minillm.engines.r0_naive", "NaiveEngine", {"use_cache": False}),
    EngineSpec("naive", 0, "minillm.engines.r0_naive", "NaiveEngine", {"use_cache": True}),
    EngineSpec("static", 1, "minillm.engines.r1_static", "StaticBatchEngine"),
    EngineSpec("dynamic", 2, "minillm.engines.r2_dynamic", "DynamicBatchEngine", servable=True),
    EngineSpec("paged", 3, "minillm.core.engine", "PagedEngine", servable=True, upgrades={
        "speculative": {"ngram": "paged+ngram", "draft": "paged+draft"},
        "tensor_parallel_size": "tensor", "pipeline_parallel_size": "pipeline",
        "enable_lora": {True: "paged+lora"}, "compile": {True: "compiled"}}, features=_PAGED),
    EngineSpec("paged+ngram", 6, _SPEC, "SpeculativeEngine", {"speculative": "ngram"},
               features=_PAGED),
    EngineSpec("paged+draft", 6, _SPEC, "SpeculativeEngine", {"speculative": "draft"},
               features=_PAGED),
    EngineSpec("pipeline", 7, "minillm.engines.r7_pipeline.engine", "PipelineEngine",
               upgrades={"tensor_parallel_size": "tensor"}, features=(_POLICY,),
               worker="minillm.engines.r7_pipeline.launcher:torchrun_worker"),
    EngineSpec("tensor", 10, "minillm.engines.r10_tensor.engine", "TensorParallelEngine",
               features=(_POLICY,), worker="minillm.engines.r10_tensor.engine:torchrun_worker"),
    EngineSpec("disagg", 11, "minillm.engines.r11_disagg.engine", "DisaggEngine", servable=True,
               features=(_POLICY, _REALTIME)),
    # rung 12's name for the paged engine with the overlapping executor (as naive-nocache is naive
    # without a cache): the same class, the option fixed
    EngineSpec("paged-async", 12, "minillm.core.engine", "PagedEngine", {"async_scheduling": True},
               servable=True, features=_PAGED),
    EngineSpec("paged+lora", 13, "minillm.engines.r13_lora.engine", "LoRAEngine",
               {"enable_lora": True}, servable=True, features=(_POLICY, _REALTIME)),
    # rung 14: the paged engine whose decode steps run compiled (``compile=True``)
    EngineSpec("compiled", 14, "minillm.engines.r14_compiled.engine", "CompiledEngine",
               {"compile": True}, servable=True, features=_PAGED),
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
    trim()      # what engines freed before this one leaves the process (runtime/heap.py)
    return spec.build(model, {**fixed, **options})


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
           "all_options", "build_components", "create_engine", "engine_kwargs",
           "get_attention_backend", "options_for", "options_from", "resolve"]
