"""``/tokenize`` and ``/detokenize``, in vLLM's shapes: what the server would feed the model for a
prompt (or a chat, template and all) and back. A client counts tokens against ``max_model_len``
before it sends a request, and a student sees what the chat template adds.

- ``POST /tokenize`` ``{"model", "prompt": text}`` or ``{"model", "messages": [...]}`` (by default
  the same encoding a completion or chat request gets: ``LLM.encode``) -> ``{"count",
  "max_model_len", "tokens", "token_strs"?}`` (``return_token_strs``: each id decoded on its
  own). vLLM's options: ``add_special_tokens`` (the tokenizer's own special tokens, a BOS say,
  around the text: by default true for a prompt, false for messages, whose chat template writes
  its own) and, with messages, ``add_generation_prompt`` (the assistant turn's header at the
  end; default true);
- ``POST /detokenize`` ``{"model", "tokens": [ids]}`` -> ``{"prompt": text}``; an id outside the
  vocabulary is a 400 naming it.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..llm import check_text
from ..request import RequestError
from .protocol import APIError, ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    return_token_strs: StrictBool = False
    add_special_tokens: Optional[StrictBool] = None     # None: true for a prompt, false for chat
    add_generation_prompt: Optional[StrictBool] = None  # messages only; None: true

    def prompt_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send exactly one of 'prompt' and 'messages'", param="prompt")
        if self.messages is not None:
            return [{"role": m.role, "content": m.text()} for m in self.messages]
        if self.add_generation_prompt is not None:
            raise APIError("add_generation_prompt applies to messages only (a prompt has no "
                           "chat template)", param="add_generation_prompt")
        return self.prompt


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    tokens: list[StrictInt] = Field(max_length=1 << 20)


def tokenize(llm, body: TokenizeRequest) -> dict:
    try:
        ids = encode(llm, body)
    except RequestError as e:
        raise APIError(str(e), param="messages" if body.messages is not None else "prompt") \
            from None
    out = {"count": len(ids), "max_model_len": llm.model.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [llm.tokenizer.decode([i]) for i in ids]
    return out


def encode(llm, body: TokenizeRequest) -> list[int]:
    """The ids of ``body``'s prompt or messages, with its options."""
    prompt = body.prompt_input()
    if isinstance(prompt, str):
        if body.add_special_tokens in (None, True):
            return llm.encode(prompt)          # what a completion request gets
        if not prompt:
            raise RequestError("empty prompt")
        return list(llm.tokenizer.encode(check_text(prompt, "prompt"), add_special_tokens=False))
    ids = llm.encode_chat(prompt, add_generation_prompt=body.add_generation_prompt is not False)
    if body.add_special_tokens:
        before, after = special_ends(llm.tokenizer)
        ids = before + ids + after
    return ids


def special_ends(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (a BOS, say): what
    encoding a probe adds to it."""
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return [], []


def detokenize(llm, body: DetokenizeRequest) -> dict:
    vocab = llm.model.config.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(f"tokens[{bad}] = {body.tokens[bad]} is not a token id of this model "
                       f"(0..{vocab - 1})", param="tokens")
    return {"prompt": llm.tokenizer.decode(body.tokens)}
