"""The ladder: one module per rung, all behind the ``Engine`` interface of ``base.py``.

``REGISTRY`` is the one list of engines: name -> class, the options its constructor takes (read
from its signature, so no list of options is kept by hand anywhere) and what it can do (abort,
n > 1 and beam search: class attributes of the engine). The CLI, the benchmark and ``LLM`` all go
through ``create_engine``. The attention backend of rung 3 is chosen here too: rung 3 itself never
imports rung 4.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

from ..core.attention import get_attention_backend
from .base import Engine, RunResult, StepOutput

# Constructor parameters that are plumbing, not user options.
_INTERNAL = {"self", "model", "use_cache", "runner", "sampler", "backend", "block_manager",
             "group", "proposer"}   # group: the pipeline's process group under torchrun (rung 7)


@dataclass(frozen=True)
class EngineSpec:
    name: str
    rung: int                         # its place on the ladder = its notebook's number
    module: str                       # the module that defines ``cls``
    cls: str
    fixed: dict = field(default_factory=dict)   # what the name implies (naive-nocache: no cache)

    def load(self) -> type[Engine]:
        return getattr(importlib.import_module(self.module), self.cls)

    @property
    def options(self) -> dict[str, inspect.Parameter]:
        """The options a user may pass, by name (parameters of the engine's constructor)."""
        params = inspect.signature(self.load().__init__).parameters
        extra = {"attention_backend": None} if self.name.startswith("paged") else {}
        if self.name == "paged":    # ``paged`` + ``speculative="ngram"`` is rung 6's engine
            extra["speculative"] = None
        opts = {k: p for k, p in params.items() if k not in _INTERNAL and k not in self.fixed}
        return opts | {k: inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v)
                       for k, v in extra.items()}

    @property
    def supports_abort(self) -> bool:
        return self.load().supports_abort

    @property
    def supports_parallel(self) -> bool:
        """n > 1 parallel samples and beam search (they need blocks that can be shared)."""
        return self.load().supports_parallel


REGISTRY: dict[str, EngineSpec] = {s.name: s for s in (
    EngineSpec("naive-nocache", 0, "minillm.engines.r0_naive", "NaiveEngine", {"use_cache": False}),
    EngineSpec("naive", 0, "minillm.engines.r0_naive", "NaiveEngine", {"use_cache": True}),
    EngineSpec("static", 1, "minillm.engines.r1_static", "StaticBatchEngine"),
    EngineSpec("dynamic", 2, "minillm.engines.r2_dynamic", "DynamicBatchEngine"),
    EngineSpec("paged", 3, "minillm.core.engine", "PagedEngine"),
    EngineSpec("paged+ngram", 6, "minillm.engines.r6_speculative.engine", "SpeculativeEngine",
               {"speculative": "ngram"}),
    EngineSpec("paged+draft", 6, "minillm.engines.r6_speculative.engine", "SpeculativeEngine",
               {"speculative": "draft"}),
    EngineSpec("pipeline", 7, "minillm.engines.r7_pipeline.engine", "PipelineEngine"),
)}
ENGINES = tuple(REGISTRY)


def create_engine(name: str, model, **options) -> Engine:
    """Build engine ``name`` for a loaded model; ``options`` go to its constructor.
    ``paged`` with ``speculative`` ("ngram", "draft" or a ``SpeculativeConfig``) builds rung 6's
    ``paged+ngram`` / ``paged+draft``."""
    speculative = options.pop("speculative", None) if name == "paged" else None
    if speculative is not None:
        method = getattr(speculative, "method", speculative)
        name = f"paged+{method}" if method in ("ngram", "draft") else ""
        if not name:
            raise ValueError(f"speculative must be 'ngram' or 'draft' (or a SpeculativeConfig), "
                             f"got {speculative!r}")
    spec = REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
    allowed = spec.options
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"bad option for engine {name!r}: {', '.join(unknown)} (it takes "
                         f"{', '.join(allowed) or 'no options'})")
    if name.startswith("paged"):
        options["backend"] = get_attention_backend(options.pop("attention_backend", None),
                                                   model.device)
    fixed = spec.fixed if speculative is None else {**spec.fixed, "speculative": speculative}
    return spec.load()(model, **fixed, **options)


def all_options() -> dict[str, inspect.Parameter]:
    """Every option any engine takes, in ladder order (the CLI makes a flag of each)."""
    out: dict[str, inspect.Parameter] = {}
    for spec in REGISTRY.values():
        out |= {k: p for k, p in spec.options.items() if k not in out}
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
           "all_options", "create_engine", "get_attention_backend", "options_for", "options_from"]
