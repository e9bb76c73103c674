"""The ladder: one module per step, all behind the ``Engine`` interface of ``base.py``."""
from __future__ import annotations

from .base import Engine, RunResult, StepOutput

ENGINES = ("naive-nocache", "naive", "static", "dynamic", "paged")


def create_engine(name: str, model, **options) -> Engine:
    """Build engine ``name`` for a loaded model; ``options`` go to its constructor."""
    if name == "naive-nocache":
        from .s0_naive import NaiveEngine
        return NaiveEngine(model, use_cache=False, **options)
    if name == "naive":
        from .s0_naive import NaiveEngine
        return NaiveEngine(model, use_cache=True, **options)
    if name == "static":
        from .s1_static import StaticBatchEngine
        return StaticBatchEngine(model, **options)
    if name == "dynamic":
        from .s2_dynamic import DynamicBatchEngine
        return DynamicBatchEngine(model, **options)
    if name == "paged":
        from .s3_paged.engine import PagedEngine
        return PagedEngine(model, **options)
    raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "Engine", "RunResult", "StepOutput", "create_engine"]
