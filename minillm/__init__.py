"""minillm: an LLM inference engine built up in steps, from a naive loop to paged attention.

Start with ``LLM`` and ``SamplingParams`` (as in vLLM); the steps live in ``minillm.engines``.

The names below load on first use (PEP 562): ``import minillm`` imports no torch, so
``python -m minillm`` handles Ctrl-C and SIGTERM from its first line on (``__main__.py``), even
while torch is still loading.
"""
from __future__ import annotations

import importlib
import os

from .openmp import bound_openmp_spin

# Before anything imports torch: libgomp reads its spin count once, when it loads (openmp.py says
# why a busy machine needs the bound).
bound_openmp_spin()

if os.environ.get("MINILLM_LABWORK_FILES"):
    # A rank spawned by a handout's notebook: the student's solutions stand in here too, before
    # any module of the engine is imported (lab/labwork.py).
    from .lab.labwork import stand_in_from_env
    stand_in_from_env()

# public name -> the module that defines it
_EXPORTS = {"LLM": ".llm", "load_model": ".models", "SamplingParams": ".request",
            "Request": ".request", "RequestOutput": ".request", "RequestError": ".request",
            "FinishReason": ".request", "LoRARequest": ".engines.r13_lora.adapter"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minillm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value     # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
