"""What goes over the wire: OpenAI's request and response shapes, and its error body.

Only the fields minillm can honour are accepted with a meaning; a field that would change the
answer but that we cannot serve (``logprobs``, ``echo``, ``best_of``, penalties) is refused with a
400 naming it, rather than silently ignored. Fields that only carry metadata (``user``) are
ignored, as the OpenAI API itself does for most clients' extras.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..request import SamplingParams


class APIError(Exception):
    """An error that becomes ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# Strict types where JSON's lax coercions would hide a client bug: "3" is not a max_tokens, true is
# not a token id, "yes" is not a stream flag.
class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextPart]]   # OpenAI's content parts: text only here

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Common(BaseModel):
    """Fields shared by both endpoints. OpenAI's defaults: 16 tokens (completions), temperature
    1. ``top_k``, ``ignore_eos``, ``return_token_ids`` are vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=0)           # vLLM's extra (0 = off here)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False                # benchmarks fix output lengths with it
    return_token_ids: StrictBool = False                # vLLM's extra: each choice's token ids too
    # fields that would change the answer, refused when set (see ``check_unsupported``)
    logprobs: Union[bool, int, None] = None
    echo: bool = False
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def check_unsupported(self) -> None:
        for name, default in (("logprobs", None), ("echo", False), ("best_of", None),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            value = getattr(self, name)
            if value not in (default, False) and not (name == "best_of" and value == self.n):
                raise APIError(f"'{name}' is not supported by minillm (got {value!r})", param=name)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(f"at most 4 stop sequences are allowed, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError("stop sequences must be non-empty strings", param="stop")
        return stops

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's ``SamplingParams``; a value it refuses becomes a 400 naming the field."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                                  top_p=self.top_p, top_k=self.top_k, seed=self.seed, n=self.n,
                                  ignore_eos=self.ignore_eos)
        except ValueError as e:   # SamplingParams' messages start with the field's name
            raise APIError(str(e), param=str(e).split(" ")[0]) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]

    def prompt_input(self):
        """One prompt: text or token ids (a one-element batch is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(f"batched prompts are not supported: send one prompt per request "
                               f"(got {len(p)})", param="prompt")
            p = p[0]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        return p


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)

    def prompt_input(self):
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# --- responses ------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, chat: bool, choices: list[dict],
                    use: dict | None, chunk: bool) -> dict:
    """A (chunk of a) completion: ``choices`` are ``{"index", "text", "finish_reason"}``."""
    kind = "chat.completion" if chat else "text_completion"
    out = []
    for c in choices:
        item = {"index": c["index"], "finish_reason": c.get("finish_reason"), "logprobs": None}
        if "token_ids" in c:
            item["token_ids"] = c["token_ids"]
        if not chat:
            item["text"] = c["text"]
        elif chunk:
            last_empty = not c["text"] and c.get("finish_reason")   # OpenAI sends delta {}
            item["delta"] = {} if last_empty else {"content": c["text"]}
            if c.get("first"):
                item["delta"]["role"] = "assistant"
        else:
            item["message"] = {"role": "assistant", "content": c["text"]}
        out.append(item)
    body = {"id": rid, "object": kind + (".chunk" if chat and chunk else ""),
            "created": int(time.time()), "model": model, "choices": out}
    if use is not None or not chunk:
        body["usage"] = use
    return body
