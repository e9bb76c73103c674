"""``/tokenize`` and ``/detokenize``, in vLLM's shapes: what the server would feed the model for a
prompt (or a chat, template and all) and back. A client counts tokens against ``max_model_len``
before it sends a request, and a student sees what the chat template adds (issue 44).

- ``POST /tokenize`` ``{"model", "prompt": text}`` or ``{"model", "messages": [...]}`` (the same
  encoding a completion or chat request gets: ``LLM.encode``; ``add_special_tokens`` as the
  tokenizer's default) -> ``{"count", "max_model_len", "tokens", "token_strs"?}``
  (``return_token_strs``: each id decoded on its own);
- ``POST /detokenize`` ``{"model", "tokens": [ids]}`` -> ``{"prompt": text}``; an id outside the
  vocabulary is a 400 naming it.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..request import RequestError
from .protocol import APIError, ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    return_token_strs: StrictBool = False

    def prompt_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send exactly one of 'prompt' and 'messages'", param="prompt")
        if self.messages is not None:
            return [{"role": m.role, "content": m.text()} for m in self.messages]
        return self.prompt


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    tokens: list[StrictInt] = Field(max_length=1 << 20)


def tokenize(llm, body: TokenizeRequest) -> dict:
    try:
        ids = llm.encode(body.prompt_input())
    except RequestError as e:
        raise APIError(str(e), param="messages" if body.messages is not None else "prompt") \
            from None
    out = {"count": len(ids), "max_model_len": llm.model.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [llm.tokenizer.decode([i]) for i in ids]
    return out


def detokenize(llm, body: DetokenizeRequest) -> dict:
    vocab = llm.model.config.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"tokens[{bad}] = {body.tokens[bad]} is not a token id of this model "
                       f"(0..{vocab - 1})", param="tokens")
    return {"prompt": llm.tokenizer.decode(body.tokens)}
