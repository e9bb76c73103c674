"""Making and checking adapters without ``peft`` (rung 13, notebook 13_multi_lora): write an
adapter in PEFT's on-disk format (what ``PeftModel.save_pretrained`` writes for a Llama: keys
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``...), and merge one into a copy
of the Hugging Face model (``W + scale * B A``: what the tests compare the engine with).
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from .adapter import (ATTENTION, CONFIG_FILE, TARGETS, WEIGHTS_FILE, LoRAAdapter, LoRARequest,
                      load_adapter)


def module_key(layer: int, module: str) -> str:
    """The module's name in the Hugging Face Llama (PEFT's keys add ``base_model.model.``)."""
    part = "self_attn" if module in ATTENTION else "mlp"
    return f"model.layers.{layer}.{part}.{module}"


def hf_shapes(hf_model) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection, as ``load_adapter`` checks the tensors against."""
    return {m: tuple(hf_model.get_submodule(module_key(0, m)).weight.shape) for m in TARGETS}


def save_peft_adapter(path: str | Path, weights: dict[tuple[int, str], tuple], r: int,
                      lora_alpha: float, use_rslora: bool = False, **config) -> Path:
    """Write ``weights[(layer, module)] = (A [r, in], B [out, r])`` as PEFT does; ``config``:
    more ``adapter_config.json`` fields (the tests write unsupported ones)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, module), (a, b) in weights.items():
        key = f"base_model.model.{module_key(layer, module)}"
        tensors[f"{key}.lora_A.weight"] = a.contiguous()
        tensors[f"{key}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(path / WEIGHTS_FILE))
    modules = sorted({m for _, m in weights}, key=TARGETS.index)
    fields = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": lora_alpha,
              "target_modules": modules, "use_rslora": use_rslora, "bias": "none",
              "lora_dropout": 0.0, "use_dora": False, "modules_to_save": None,
              "layers_to_transform": None, "fan_in_fan_out": False, **config}
    (path / CONFIG_FILE).write_text(json.dumps(fields, indent=2))
    return path


def save_random_adapter(path: str | Path, hf_model, r: int = 8, lora_alpha: float = 16,
                        targets: tuple[str, ...] = ("q_proj", "v_proj"), use_rslora: bool = False,
                        seed: int = 0, std: float = 0.5, **config) -> Path:
    """A random adapter for ``hf_model`` in PEFT's format. PEFT starts B at zero (an untrained
    adapter changes nothing); here both are random, sized so that ``scale * B A x`` moves a
    layer's output by about ``std`` of its own size: enough to change the tokens."""
    g = torch.Generator().manual_seed(seed)
    shapes = hf_shapes(hf_model)
    scale = lora_alpha / (math.sqrt(r) if use_rslora else r)
    weights = {}
    for layer in range(hf_model.config.num_hidden_layers):
        for m in targets:
            out, inp = shapes[m]
            w = hf_model.get_submodule(module_key(layer, m)).weight.detach().float()
            a = torch.randn(r, inp, generator=g) / math.sqrt(inp)
            b = torch.randn(out, r, generator=g) * (std * w.std().item() * math.sqrt(inp / r)
                                                    / scale)
            weights[layer, m] = (a, b)
    return save_peft_adapter(path, weights, r, lora_alpha, use_rslora, **config)


def read_adapter(request: LoRARequest, hf_model, max_lora_rank: int = 256) -> LoRAAdapter:
    """``load_adapter`` for a Hugging Face model (its shapes and dtype)."""
    return load_adapter(request, hf_shapes(hf_model), hf_model.config.num_hidden_layers,
                        max_lora_rank, next(hf_model.parameters()).dtype)


@torch.no_grad()
def merged_model(hf_model, adapter: LoRAAdapter):
    """A copy of ``hf_model`` with ``adapter`` merged into its weights (``W += scale * B A``, in
    fp64 then rounded once): the reference a served adapter must equal."""
    merged = copy.deepcopy(hf_model)
    for (layer, module), (a, b) in adapter.weights.items():
        w = merged.get_submodule(module_key(layer, module)).weight
        delta = (b.double() @ a.double()).to(w.device)   # adapters load on the CPU
        w.copy_((w.double() + adapter.scale * delta).to(w.dtype))
    return merged
