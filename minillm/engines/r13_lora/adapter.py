"""Rung 13 — LoRA adapters as PEFT saves them, read without ``peft`` (notebook 13_multi_lora).

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``...) and ``adapter_model.safetensors``: for each adapted projection of each layer a
pair ``...layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``. The adapted layer computes ``W x + scale * B (A x)``, ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``): the same as the merged weight ``W + scale * B A``,
without ever changing ``W`` — which is what lets one batch serve many adapters.

Only what the engine computes is accepted; a field asking for more (a bias, DoRA, saved modules,
embedding LoRA, per-layer patterns...) is a ``ValueError`` naming it, never silently ignored.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EMBEDDINGS = ("embed_tokens", "lm_head")
# PEFT fields whose non-default values ask for something this engine does not compute
UNSUPPORTED = ("use_dora", "modules_to_save", "layers_to_transform", "layers_pattern",
               "rank_pattern", "alpha_pattern", "fan_in_fan_out", "lora_bias",
               "layer_replication", "trainable_token_indices", "use_qalora", "target_parameters")
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                 r"(\w+)\.lora_([AB])\.weight")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's ``LoRARequest``; vLLM's second argument is an
    int id, which here is derived: ``lora_int_id`` is assigned by the engine when omitted)."""

    lora_name: str
    lora_path: str
    lora_int_id: int | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise ValueError(f"lora_path must be a directory path, got {self.lora_path!r} (vLLM "
                             "writes LoRARequest(name, int_id, path); here it is (name, path))")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass
class LoRAAdapter:
    """One adapter in host memory: ``weights[(layer, module)] = (A [r, in], B [out, r])``."""

    name: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> list[str]:
        return [m for m in TARGETS if any(k[1] == m for k in self.weights)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_config(path: Path, max_lora_rank: int) -> tuple[int, float]:
    """(r, scale) from ``adapter_config.json``, every field this engine cannot honour refused."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no {CONFIG_FILE} (not a PEFT adapter "
                         "directory)")
    config = json.loads(file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type must be 'LORA', got {config['peft_type']!r}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias={config['bias']!r} is not supported (only 'none')")
    for name in UNSUPPORTED:
        if config.get(name) not in (None, False, "", [], {}):
            raise ValueError(f"{name}={config[name]!r} is not supported by minillm's LoRA")
    check_targets(config.get("target_modules"))
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be an integer >= 1, got {r!r}")
    if r > max_lora_rank:
        raise ValueError(f"r={r} exceeds max_lora_rank={max_lora_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"use_rslora must be true or false, got {rslora!r}")
    return r, alpha / (math.sqrt(r) if rslora else r)


def check_targets(targets) -> None:
    """``target_modules``: names among ``TARGETS`` (dotted suffixes allowed), ``all-linear``,
    or a regex (PEFT's string form: which modules it hit is read from the weights)."""
    if targets is None or isinstance(targets, str):
        return
    for t in targets:
        last = str(t).rsplit(".", 1)[-1]
        if last in EMBEDDINGS:
            raise ValueError(f"target_modules: {t!r} is embedding LoRA, which is not supported")
        if last not in TARGETS:
            raise ValueError(f"target_modules: {t!r} is not one of {', '.join(TARGETS)}")


def load_adapter(request: LoRARequest, shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read ``request``'s adapter for a model whose projections have ``shapes[module] = (out,
    in)``; every tensor's name and shape is checked against the model."""
    from safetensors.torch import load_file

    path = Path(request.lora_path)
    r, scale = read_config(path, max_lora_rank)
    if not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"LoRA adapter {request.lora_name!r}: no {WEIGHTS_FILE} in {str(path)!r}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(path / WEIGHTS_FILE)).items():
        m = KEY.fullmatch(key)
        if m is None or m[2] not in TARGETS or int(m[1]) >= num_layers:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: tensor {key!r} is not a "
                             f"lora_A/lora_B weight of a projection of this {num_layers}-layer "
                             "model (embedding LoRA, DoRA and biases are not supported)")
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = t
    weights = {k: check_pair(k, ab, shapes[k[1]], r, dtype) for k, ab in pairs.items()}
    return LoRAAdapter(request.lora_name, r, scale, weights)


def check_pair(where: tuple[int, str], ab: dict, shape: tuple[int, int], r: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    layer, module = where
    if set(ab) != {"A", "B"}:
        raise ValueError(f"layer {layer} {module}: lora_A and lora_B must both be present")
    a, b = ab["A"], ab["B"]
    out, inp = shape
    if tuple(a.shape) != (r, inp) or tuple(b.shape) != (out, r):
        raise ValueError(f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                         f"{tuple(b.shape)} do not fit r={r} and the weight's (out, in) = {shape}")
    return a.to(dtype), b.to(dtype)
