"""What the server answers: OpenAI's completion and chat-completion bodies and their streamed
chunks (the request shapes and the error body are in ``protocol.py``)."""
from __future__ import annotations

import time
import uuid


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
        item = {"index": c["index"], "finish_reason": c.get("finish_reason"),
                "logprobs": c.get("logprobs")}
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
