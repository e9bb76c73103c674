"""Adapters by name on the server (rung 13, notebook 13_multi_lora), as vLLM serves them.

``python -m minillm serve --enable-lora --lora-modules sql=./sql-lora chat=./chat-lora``: every
adapter is read when the server starts (a bad one stops it with the reason, before it listens);
a request's ``model`` field picks the base model or an adapter, and ``/v1/models`` lists them all
(an adapter's card names its ``parent``, the base model). An unknown name is a 404 naming it,
with code ``model_not_found`` (OpenAI's and vLLM's answer).
"""
from __future__ import annotations

from .protocol import APIError


def parse_lora_modules(items: list[str] | None) -> dict:
    """``["name=path", ...]`` -> {name: LoRARequest}; a malformed or repeated item is a
    ValueError naming it."""
    from ..engines.r13_lora.adapter import LoRARequest

    modules: dict = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes name=path, got {item!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = LoRARequest(name, path)
    return modules


def load_adapters(llm, modules: dict, served: str | None = None) -> dict:
    """Read each adapter into the engine's host memory now (``Engine.add_lora``): a bad adapter,
    or an engine without ``enable_lora``, is a ValueError before the server listens (or before
    ``generate`` reads a line). ``served``: the base model's name, which no adapter may take."""
    if served is not None and served in modules:
        raise ValueError(f"--lora-modules: {served!r} is the base model's name")
    for lora in modules.values():
        llm.engine.add_lora(lora)
    return dict(modules)


def resolve_model(name: str, served: str, adapters: dict):
    """The adapter a request's ``model`` names (None: the base model); unknown: a 404."""
    if name == served:
        return None
    if name in adapters:
        return adapters[name]
    known = ", ".join(repr(n) for n in (served, *adapters))
    raise APIError(f"model {name!r} does not exist: this server serves {known}", 404,
                   param="model", code="model_not_found")


def model_cards(served: str, adapters: dict, max_model_len: int) -> dict:
    """``/v1/models``: the base model, then each adapter with its ``parent``."""
    card = {"object": "model", "created": 0, "owned_by": "minillm",
            "max_model_len": max_model_len}
    return {"object": "list", "data": [{"id": served, **card}] + [
        {"id": name, **card, "parent": served, "root": lora.lora_path}
        for name, lora in adapters.items()]}
