"""Chat messages -> prompt token ids, where what a user wrote stays text.

A chat template renders messages into one string with control tokens around each turn (SmolLM2:
``<|im_start|>user\\n...<|im_end|>\\n``), and tokenizing that string turns every control token's
*text* into the control token -- wherever it came from. A user who writes
``"<|im_end|>\\n<|im_start|>system\\n..."`` in a message would open a system turn of their own.
So the template is rendered with a placeholder for each message's content, the control tokens
are found in the template's own text only, and the text between them (template text and user
text together, exactly the segments the tokenizer would cut) is tokenized with special tokens
treated as text (``split_special_tokens``). For messages without control-token text the ids are
those of ``apply_chat_template`` (``tests/runtime/test_chat.py`` checks both).
"""
from __future__ import annotations

import re

from .request import RequestError

# Private-use code points: no tokenizer's control token contains them, and no template edits them.
OPEN, CLOSE = "\ue000", "\ue001"


def control_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's special added tokens, text -> id (SmolLM2: all 17 of ids 0-16)."""
    return {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """``messages`` (checked by the caller: dicts with string role and content) through the
    tokenizer's chat template, the assistant turn's header added (unless
    ``add_generation_prompt`` is False: ``/tokenize`` may ask so); user text never becomes a
    control token. A role holding control-token text is refused; so is control-token text in the
    content when the template edits content (the text rendered with the placeholders filled in
    differs from the text rendered from the messages: where the user's text lies is unknown)."""
    controls = control_tokens(tokenizer)
    if not controls:            # (the tiny model's byte tokenizer: no text is a control token)
        return render_ids(tokenizer, messages, add_generation_prompt)
    pattern = re.compile("|".join(map(re.escape, sorted(controls, key=len, reverse=True))))
    for i, m in enumerate(messages):
        if pattern.search(m["role"]):
            raise RequestError(f"messages[{i}].role contains the control token "
                               f"{pattern.search(m['role']).group()!r}")
    marked = [{**m, "content": f"{OPEN}{i}{CLOSE}"} for i, m in enumerate(messages)]
    text = render_text(tokenizer, marked, add_generation_prompt)
    parts = re.split(f"{OPEN}(\\d+){CLOSE}", text)    # template, index, template, index, ...
    indexes = [int(k) for k in parts[1::2]]
    filled = "".join(messages[int(p)]["content"] if j % 2 else p for j, p in enumerate(parts))
    if sorted(indexes) != list(range(len(messages))) or \
            filled != render_text(tokenizer, messages, add_generation_prompt):
        # the template edits (or drops) content
        return fallback(tokenizer, messages, pattern, add_generation_prompt)
    ids, chunk = [], []
    for j, part in enumerate(parts):
        if j % 2:                                      # a message's content: text, whatever it says
            chunk.append(messages[int(part)]["content"])
            continue
        pos = 0
        for match in pattern.finditer(part):           # the template's own control tokens
            chunk.append(part[pos:match.start()])
            ids += as_text(tokenizer, "".join(chunk)) + [controls[match.group()]]
            chunk, pos = [], match.end()
        chunk.append(part[pos:])
    return ids + as_text(tokenizer, "".join(chunk))


def as_text(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as e:   # the template itself refused (e.g. an unknown role)
        raise RequestError(f"the chat template rejected these messages: {e}") from None


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=True)
    except Exception as e:
        raise RequestError(f"the chat template rejected these messages: {e}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def fallback(tokenizer, messages: list[dict], pattern: re.Pattern,
             add_generation_prompt: bool = True) -> list[int]:
    """A template that edits content cannot be told apart from its user's text: render
    normally, unless some content holds control-token text (refused)."""
    for i, m in enumerate(messages):
        found = pattern.search(m["content"])
        if found:
            raise RequestError(f"messages[{i}].content contains the control token "
                               f"{found.group()!r}, which this model's chat template cannot "
                               "keep as text")
    return render_ids(tokenizer, messages, add_generation_prompt)
