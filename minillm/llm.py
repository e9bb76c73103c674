"""``LLM``: the public face, shaped like vLLM's. Picks an engine, turns prompts into Requests.

    from minillm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", engine="paged")
    outs = llm.generate([[{"role": "user", "content": "Hi!"}]], SamplingParams(max_tokens=32))
"""
from __future__ import annotations

import itertools
import numbers
from typing import Sequence, Union

import torch

from .chat import encode_chat
from .engines import ENGINES, RunResult, create_engine
from .runtime.interface import OnOutput, OnStep
from .models import DEFAULT_MODEL, LoadedModel, load_model, resolve_dtype
from .request import Request, RequestError, RequestOutput, SamplingParams

# A prompt is raw text, a chat (list of {"role", "content"} messages), a list of token ids, or a
# dict with one of "prompt" / "messages" / "prompt_token_ids".
Prompt = Union[str, list, dict]


class LLM:
    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, engine: str = "paged",
                 device: str | None = None, dtype: str | torch.dtype | None = None,
                 threads: int | None = None, **engine_options):
        """``engine_options``: the engine's options (its config fields, flat); the registry
        routes ``paged`` with ``speculative=`` or ``pipeline_parallel_size=`` to rung 6 or 7.
        ``dtype`` (a model name only): ``auto``, ``float32``, ``bfloat16``, ``float16``
        (``models.resolve_dtype``; by default fp32 on a CPU, where tokens equal HF's fp32 ones).
        ``threads``: torch's intra-op threads for this process (``torch.set_num_threads``)."""
        if engine not in ENGINES:   # (before the model loads)
            raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
        if threads is not None:
            torch.set_num_threads(check_threads(threads))
        if isinstance(model, LoadedModel):
            if dtype is not None and resolve_dtype(dtype, model.device) != model.dtype:
                raise ValueError(f"dtype {dtype!r} asked for a model loaded in {model.dtype}: "
                                 "pass dtype to load_model instead")
            self.model = model
        else:
            self.model = load_model(model, device, dtype)
        self.tokenizer = self.model.tokenizer
        if engine_options.get("enable_lora") is False:     # off: the engine named, as is
            del engine_options["enable_lora"]
        try:
            self.engine = create_engine(engine, self.model, **engine_options)
        except TypeError as e:  # an option this engine does not take
            raise ValueError(f"bad option for engine {engine!r}: {e}") from None
        self._ids = itertools.count()   # request ids, unique for the life of this LLM

    # --- prompts -> token ids ----------------------------------------------------------------------
    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """Apply the model's chat template (adds the assistant turn header, unless
        ``add_generation_prompt`` is False); what the messages say is tokenized as text, never
        as control tokens (``chat.py``)."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {'role', 'content'} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise RequestError(f"messages[{i}] must be a dict with string 'role' and "
                                   f"'content', got {m!r:.80}")
            check_text(m["content"], f"messages[{i}].content")
        return encode_chat(self.tokenizer, messages, add_generation_prompt)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt")
            return list(self.tokenizer.encode(check_text(prompt, "prompt")))
        if isinstance(prompt, dict):
            keys = [k for k in ("prompt_token_ids", "messages", "prompt") if k in prompt]
            if len(keys) != 1:
                raise RequestError("a prompt dict needs exactly one of 'prompt', 'messages', "
                                   f"'prompt_token_ids', got keys {sorted(map(str, prompt))}")
            value = prompt[keys[0]]
            if keys[0] == "prompt" and not isinstance(value, str):
                raise RequestError(f"'prompt' must be a string, got {type(value).__name__}")
            if keys[0] == "prompt_token_ids" and not isinstance(value, (list, tuple)):
                raise RequestError("'prompt_token_ids' must be a list of token ids, got "
                                   f"{type(value).__name__}")
            return self.encode_chat(value) if keys[0] == "messages" else self.encode(value)
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            return self.encode_chat(list(prompt))
        if isinstance(prompt, (list, tuple)):
            return list(prompt)  # token ids; the engine checks their types and range
        raise RequestError(f"cannot understand a prompt of type {type(prompt).__name__}")

    def make_requests(self, prompts: Sequence[Prompt],
                      params: SamplingParams | Sequence[SamplingParams] | None = None,
                      lora_request=None) -> list[Request]:
        """One ``Request`` per prompt, with ids unique for the life of this ``LLM``. A prompt that
        cannot be encoded becomes a request that the engine answers with its error.
        ``lora_request``: see ``generate``."""
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        plist = [SamplingParams.coerce(p) for p in plist]
        loras = self.lora_requests(lora_request, len(prompts))
        reqs = []
        for prompt, p, lora in zip(prompts, plist, loras):
            try:
                ids, err = self.encode(prompt), None
            except RequestError as e:
                ids, err = [], str(e)
            req = Request(ids, p, request_id=str(next(self._ids)), lora_request=lora)
            req.error = err   # set: the engine rejects the request with this message
            reqs.append(req)
        return reqs

    def lora_requests(self, lora_request, n: int) -> list:
        """One adapter (or None) per prompt, each adapter read now: a bad one is a ValueError
        naming it before anything runs (rung 13: ``LLM(..., enable_lora=True)``)."""
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) \
            else [lora_request] * n
        if len(loras) != n:
            raise ValueError(f"{n} prompts but {len(loras)} lora_request entries")
        if any(lora is not None for lora in loras) and not self.engine.supports_lora:
            raise ValueError(f"lora_request needs LLM(..., enable_lora=True) (engine "
                             f"{self.engine.name!r} serves the base model only)")
        for lora in loras:
            if lora is not None:
                self.engine.add_lora(lora)
        return loras

    # --- running -------------------------------------------------------------------------------------
    def run(self, requests: list[Request], on_step: OnStep | None = None,
            progress: bool = False, on_output: OnOutput | None = None) -> RunResult:
        """``Engine.run``: calls from several threads run one after another."""
        return self.engine.run(requests, on_step=on_step, progress=progress, on_output=on_output)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | dict | None = None,
                 on_step: OnStep | None = None, progress: bool = False,
                 on_output: OnOutput | None = None, lora_request=None) -> list[RequestOutput]:
        """Generate for every prompt; bad prompts get an output with finish_reason ``error``.
        ``lora_request`` (rung 13, ``enable_lora=True``): a ``LoRARequest`` for every prompt, or
        a list of one per prompt, None for the base model."""
        if isinstance(prompts, (str, dict)) or _is_one_chat(prompts) or _is_one_id_list(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got "
                             f"{type(prompts).__name__}")
        result = self.run(self.make_requests(prompts, params, lora_request), on_step=on_step,
                          progress=progress, on_output=on_output)
        return result.outputs


def _is_one_chat(prompts) -> bool:
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], dict) \
        and "role" in prompts[0]


def _is_one_id_list(prompts) -> bool:
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], numbers.Integral)


def check_threads(threads) -> int:
    """A thread count: an integer >= 1 (``--threads``, ``LLM(threads=)``)."""
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    return int(threads)


def check_text(text: str, what: str) -> str:
    """Text the tokenizer can take: valid Unicode (no lone surrogates from a bad decode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} is not valid Unicode: {e.reason} at position {e.start} "
                           f"({text[e.start]!r})") from None
    return text
