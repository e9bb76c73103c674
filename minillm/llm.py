"""``LLM``: the public face, shaped like vLLM's. Picks an engine, turns prompts into Requests.

    from minillm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", engine="paged")
    outs = llm.generate([[{"role": "user", "content": "Hi!"}]], SamplingParams(max_tokens=32))
"""
from __future__ import annotations

from typing import Sequence, Union

from .engines import ENGINES, RunResult, create_engine
from .engines.base import OnStep
from .models import DEFAULT_MODEL, LoadedModel, load_model
from .request import Request, RequestError, RequestOutput, SamplingParams

# A prompt is raw text, a chat (list of {"role", "content"} messages), a list of token ids, or a
# dict with one of "prompt" / "messages" / "prompt_token_ids".
Prompt = Union[str, list, dict]


class LLM:
    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, engine: str = "paged",
                 device: str | None = None, **engine_options):
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
        self.model = model if isinstance(model, LoadedModel) else load_model(model, device)
        self.tokenizer = self.model.tokenizer
        try:
            self.engine = create_engine(engine, self.model, **engine_options)
        except TypeError as e:  # an option this engine does not take
            raise ValueError(f"bad option for engine {engine!r}: {e}") from None

    # --- prompts -> token ids ----------------------------------------------------------------------
    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Apply the model's chat template (adds the assistant turn header)."""
        if not messages or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise RequestError("messages must be a non-empty list of {'role', 'content'} dicts")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("empty prompt")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            for key in ("prompt_token_ids", "messages", "prompt"):
                if key in prompt:
                    return self.encode(prompt[key]) if key != "messages" else self.encode_chat(prompt[key])
            raise RequestError("prompt dict needs 'prompt', 'messages' or 'prompt_token_ids'")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.encode_chat(prompt)
        if isinstance(prompt, list):
            return list(prompt)  # token ids; the engine validates their range
        raise RequestError(f"cannot understand a prompt of type {type(prompt).__name__}")

    def make_requests(self, prompts: Sequence[Prompt],
                      params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Request]:
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                ids = self.encode(prompt)
            except RequestError as e:
                ids, err = [], str(e)
            else:
                err = None
            req = Request(ids, p, request_id=str(i))
            if err:  # an empty token list makes the engine reject it with this message
                req.error = err
            reqs.append(req)
        return reqs

    # --- running -------------------------------------------------------------------------------------
    def run(self, requests: list[Request], on_step: OnStep | None = None,
            progress: bool = False) -> RunResult:
        return self.engine.run(requests, on_step=on_step, progress=progress)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_step: OnStep | None = None, progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; bad prompts get an output with finish_reason ``error``."""
        one_chat = isinstance(prompts, list) and prompts and isinstance(prompts[0], dict) \
            and "role" in prompts[0]
        if isinstance(prompts, (str, dict)) or one_chat or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        result = self.run(self.make_requests(prompts, params), on_step=on_step, progress=progress)
        return result.outputs
