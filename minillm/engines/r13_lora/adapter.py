"""Rung 13 — LoRA adapters as PEFT saves them, read without ``peft`` (notebook 13_multi_lora).

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``...) and ``adapter_model.safetensors``: for each adapted projection of each layer a
pair ``...layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``. The adapted layer computes ``W x + scale * B (A x)``, ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``): the same as the merged weight ``W + scale * B A``,
without ever changing ``W`` — which is what lets one batch serve many adapters.

Only what the engine computes is accepted; a field asking for more (a bias, DoRA, saved modules,
embedding LoRA, per-layer patterns...) is refused by name, never silently ignored. So is anything
that would make a request decode garbage rather than fail: a config that is not a JSON object, a
scale that is not a finite, moderate number, a file that is not safetensors, no tensors, integer
tensors, a NaN or infinity in a weight (or in ``scale * B`` in the model's dtype), a tensor that
maps to no projection of the model. Every refusal is one ``AdapterError`` naming the adapter.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...checks import show

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = TARGETS[:4]                  # under ``self_attn``; the others under ``mlp``
EMBEDDINGS = ("embed_tokens", "lm_head")
# PEFT fields whose non-default values ask for something this engine does not compute
UNSUPPORTED = ("use_dora", "modules_to_save", "layers_to_transform", "layers_pattern",
               "rank_pattern", "alpha_pattern", "fan_in_fan_out", "lora_bias",
               "layer_replication", "trainable_token_indices", "use_qalora", "target_parameters")
# the layer index in ASCII digits: int() also reads "00" and "٣", which would alias a layer
KEY = re.compile(r"base_model\.model\.(model\.layers\.([0-9]+)\.(self_attn|mlp)\.(\w+))"
                 r"\.lora_([AB])\.weight", re.ASCII)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# The largest scale (lora_alpha / r) accepted: PEFT's default (lora_alpha = r) gives 1, rsLoRA with
# lora_alpha = 2r at r = 256 gives 32. Far past those a config is broken (1e308 loads as a float),
# and its deltas would swamp the model's own product.
MAX_LORA_SCALE = 1024.0


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served: its name and path, then what is wrong with it."""

    def __init__(self, lora: LoRARequest, problem: str):
        self.lora_name, self.lora_path, self.problem = lora.lora_name, lora.lora_path, problem
        super().__init__(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path!r}): {problem}")


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


def load_adapter(request: LoRARequest, shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read ``request``'s adapter for a model whose projections have ``shapes[module] = (out,
    in)``, every field and tensor checked against the model; anything wrong is an
    ``AdapterError`` naming the adapter and the field or tensor."""
    path = Path(request.lora_path)
    try:
        config = read_json(path)
        r, scale = read_config(config, max_lora_rank)
        tensors = read_tensors(path)
        pairs = match_keys(tensors, config.get("target_modules"), num_layers)
        weights = {k: check_pair(ab, shapes[k[1]], r, scale, dtype) for k, ab in pairs.items()}
    except ValueError as e:
        raise AdapterError(request, str(e)) from None
    return LoRAAdapter(request.lora_name, r, scale, weights)


def read_json(path: Path) -> dict:
    """``adapter_config.json``, which must be a JSON object."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read {CONFIG_FILE}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:   # not UTF-8, not JSON, nested too deeply
        raise ValueError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}")
    return config


def read_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    """(r, scale) from the config, every field this engine cannot honour refused."""
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
        raise ValueError(f"r must be an integer >= 1, got {show(r)}")
    if r > max_lora_rank:
        raise ValueError(f"r={show(r)} exceeds max_lora_rank={max_lora_rank}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"use_rslora must be true or false, got {rslora!r}")
    return r, lora_scale(alpha, r, rslora)


def lora_scale(alpha, r: int, rslora: bool) -> float:
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), refused unless in (0, MAX_LORA_SCALE]."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_alpha must be a number, got {alpha!r}")
    try:
        scale = alpha / (math.sqrt(r) if rslora else r)
    except OverflowError:               # an integer too large for a float
        scale = math.inf
    if not (math.isfinite(scale) and 0 < scale <= MAX_LORA_SCALE):
        raise ValueError(f"lora_alpha={show(alpha)} with r={r} gives the scale {scale:g}, outside "
                         f"(0, {MAX_LORA_SCALE:g}] (lora_alpha must be a finite number > 0)")
    return scale


def check_targets(targets) -> None:
    """``target_modules``: names among ``TARGETS`` (dotted suffixes allowed), ``all-linear``,
    or a regex (PEFT's string form: which modules it hit is read from the weights)."""
    if targets is None:
        return
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise ValueError(f"target_modules={targets!r} is not a valid regex: {e}") from None
        return
    if not isinstance(targets, list):
        raise ValueError(f"target_modules must be a list of module names or a string, got "
                         f"{targets!r}")
    for t in targets:
        if not isinstance(t, str):
            raise ValueError(f"target_modules: {t!r} is not a module name")
        last = t.rsplit(".", 1)[-1]
        if last in EMBEDDINGS:
            raise ValueError(f"target_modules: {t!r} is embedding LoRA, which is not supported")
        if last not in TARGETS:
            raise ValueError(f"target_modules: {t!r} is not one of {', '.join(TARGETS)}")


def targeted(targets, module: str) -> bool:
    """Whether PEFT would wrap the module named ``module`` (``model.layers.0.self_attn.q_proj``)
    for ``target_modules``: a tensor of a module it would not wrap is never loaded by PEFT."""
    if targets is None or targets == "all-linear":
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter_model.safetensors`` (at least one, each floating point)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"no {WEIGHTS_FILE} in {str(path)!r}")
    try:
        tensors = load_file(str(file))
    except OSError as e:
        raise ValueError(f"cannot read {WEIGHTS_FILE}: {e.strerror or e}") from None
    except SafetensorError as e:
        raise ValueError(f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from None
    if not tensors:
        raise ValueError(f"{WEIGHTS_FILE} holds no tensors")
    for key, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"tensor {key!r} is {t.dtype}, not floating point")
    return tensors


def match_keys(tensors: dict[str, torch.Tensor], targets, num_layers: int
               ) -> dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]]:
    """``{(layer, module): {"A": (key, A), "B": (key, B)}}``: each key must name a lora_A or
    lora_B weight of a projection of this model that ``target_modules`` targets."""
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        m = KEY.fullmatch(key)
        if m is None or m[4] not in TARGETS or m[3] != ("self_attn" if m[4] in ATTENTION
                                                         else "mlp"):
            raise ValueError(f"tensor {key!r} is not a lora_A/lora_B weight of a projection "
                             "(embedding LoRA, DoRA and biases are not supported)")
        if m[2] != str(int(m[2])):
            raise ValueError(f"tensor {key!r}: layer index {m[2]!r} is not canonical (it would "
                             f"alias layer {int(m[2])})")
        if int(m[2]) >= num_layers:
            raise ValueError(f"tensor {key!r}: layer {m[2]} is past this {num_layers}-layer "
                             "model's last")
        if not targeted(targets, m[1]):
            raise ValueError(f"tensor {key!r}: target_modules={targets!r} does not target "
                             f"{m[1]!r} (PEFT would not load it)")
        pairs.setdefault((int(m[2]), m[4]), {})[m[5]] = (key, t)
    return pairs


def check_pair(ab: dict[str, tuple[str, torch.Tensor]], shape: tuple[int, int], r: int,
               scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's (A, B) in ``dtype``: both present, shaped for r and the weight's (out,
    in), finite, and ``scale * B`` (what a slot stores) finite in ``dtype`` too."""
    if set(ab) != {"A", "B"}:
        (key, _), = ab.values()
        raise ValueError(f"tensor {key!r} has no lora_{'B' if 'A' in ab else 'A'} partner: "
                         "lora_A and lora_B must both be present")
    (key_a, a), (key_b, b) = ab["A"], ab["B"]
    out, inp = shape
    if tuple(a.shape) != (r, inp) or tuple(b.shape) != (out, r):
        raise ValueError(f"tensors {key_a!r} {tuple(a.shape)} and {key_b!r} {tuple(b.shape)} "
                         f"do not fit r={r} and the weight's (out, in) = {shape}")
    for key, t in ((key_a, a), (key_b, b)):
        if not torch.isfinite(t).all():
            raise ValueError(f"tensor {key!r} holds NaN or infinity")
    a, b = a.to(dtype), b.to(dtype)
    for key, t, what in ((key_a, a, "its values"), (key_b, b * scale, f"scale {scale:g} * it")):
        if not torch.isfinite(t).all():
            raise ValueError(f"tensor {key!r}: {what} overflow {dtype} (the model's dtype)")
    return a, b
