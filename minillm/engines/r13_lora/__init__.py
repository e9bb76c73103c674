"""Rung 13: multi-LoRA serving, one batch running many adapters (notebook 13_multi_lora).

``adapter.py`` reads PEFT adapters (``LoRARequest``), ``slots.py`` keeps ``max_loras`` of them on
the device (LRU swapping from host memory), ``kernels.py`` computes each row's delta (Punica's
sgmv and bgmv in torch), ``layers.py`` wraps the core's linear layers, ``engine.py`` is rung 3's
engine through its seams (``make_runner``, ``schedule_step``); ``Request.cache_salt`` keeps
each adapter's cached prefix blocks apart.
"""
from .adapter import AdapterError, LoRAAdapter, LoRARequest, load_adapter
from .config import LoRAConfig

__all__ = ["AdapterError", "LoRAAdapter", "LoRAConfig", "LoRARequest", "load_adapter"]
