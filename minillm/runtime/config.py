"""Engine options: every option is a field of a frozen config dataclass, one per concern, in
vLLM's vocabulary (the core's ``CacheConfig`` and ``SchedulerConfig``, the kernels'
``ModelConfig``; rungs add theirs: ``StaticConfig``, ``SpeculativeConfig``, ``ParallelConfig``...).

A field's keyword (and the CLI's ``--flag``) is its name, or ``metadata["option"]``; its help and
extra CLI flags live in the field's metadata too (``option`` below). An engine lists the configs
it takes (``Engine.configs``); the registry, the CLI and ``LLM`` read every option from there, so
no list of options is kept by hand. A config is checked once, when it is made: a bad value is a
``ValueError`` naming the field and the value, and a config that exists is valid (it cannot be
changed afterwards).
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field

from ..checks import check_int


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


__all__ = ["Option", "build_configs", "check_bool", "config_attr", "option", "option_value",
           "options_of", "set_checked"]
