"""Log-probabilities in OpenAI's response shapes (what ``SamplingParams.logprobs`` and
``prompt_logprobs`` computed: ``minillm/logprobs.py``).

* completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per
  token; with ``echo`` the prompt's tokens come first, the very first with ``null`` logprob and
  top logprobs (nothing precedes it). ``top_logprobs`` maps token *text* to logprob and holds the
  chosen token beside the top k (vLLM's shape; lm-evaluation-harness checks greediness with it).
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``, the top k only.

A token's text is its own decoding (vLLM does the same), so ``text_offset`` is the running sum of
those lengths; a token that is half a UTF-8 character shows as U+FFFD there, as in vLLM.
JSON has no -inf, NaN or inf (Python's encoder refuses them: a 500): a logprob below ``FLOOR``
is sent as ``FLOOR`` (vLLM's -9999.0), and so is NaN, which only a row with no allowed token
gives (the sampler never draws from one); +inf, which no softmax gives, as 0.0.
"""
from __future__ import annotations

import math

FLOOR = -9999.0

TokenLogprobs = dict[int, float]


def clamp(x: float) -> float:
    """``x`` as a finite logprob JSON can carry."""
    if math.isnan(x) or x < FLOOR:
        return FLOOR
    return min(x, 0.0) if math.isinf(x) else x


class TokenText:
    """Each token id's text, decoded once per id (a prompt of 2,000 tokens repeats many)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = self.tokenizer.decode([token])
        return self.cache[token]


def completion_logprobs(text_of: TokenText, ids: list[int], entries: list[TokenLogprobs | None],
                        offset: int = 0) -> tuple[dict, int]:
    """The completions ``logprobs`` object for tokens ``ids`` (``entries[i]``: token i's dict, or
    None for the prompt's first token) whose text starts at character ``offset``; and the offset
    after them (a stream's next chunk starts there)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(ids, entries):
        text = text_of(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(clamp(entry[token]))
        top: dict[str, float] = {}
        for t, v in sorted(entry.items(), key=lambda tv: -tv[1]):   # two ids, one text: the max
            top.setdefault(text_of(t), clamp(v))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(text_of: TokenText, ids: list[int], entries: list[TokenLogprobs],
                  k: int) -> list[dict]:
    """The chat ``logprobs.content`` items for tokens ``ids``: each with its ``k`` most likely
    alternatives, most likely first."""
    def item(token: int, value: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": clamp(value), "bytes": list(text.encode("utf-8"))}

    content = []
    for token, entry in zip(ids, entries):
        top = sorted(entry.items(), key=lambda tv: -tv[1])[:k]
        content.append({**item(token, entry[token]),
                        "top_logprobs": [item(t, v) for t, v in top]})
    return content


def merge_completion(a: dict | None, b: dict) -> dict:
    """Two completions ``logprobs`` objects one after the other (echoed prompt, then output)."""
    if a is None:
        return b
    return {key: a[key] + b[key] for key in b}


class AnswerLogprobs:
    """What one answer adds to its choices' text: the echoed prompt (completions' ``echo``) and
    each token's logprobs; ``whole`` for a finished answer, ``first`` and ``take`` for a stream's
    chunks as the tokens arrive. It reads the request's committed ``outputs`` and
    ``prompt_logprobs`` only for tokens an event already delivered: the engine wrote them before
    it published those tokens, and never changes them afterwards."""

    def __init__(self, tokenizer, req, chat: bool, echo: str | None):
        self.text_of, self.req, self.chat, self.echo = TokenText(tokenizer), req, chat, echo
        self.k = req.params.logprobs
        n = req.params.n
        self.taken, self.offset, self.echoed = [0] * n, [0] * n, [False] * n

    @classmethod
    def asked(cls, tokenizer, req, chat: bool, echo) -> "AnswerLogprobs | None":
        """For a request that asks ``logprobs`` or echoes ``echo`` (its prompt: text, or token
        ids decoded here), else None."""
        if echo is None and req.params.logprobs is None:
            return None
        return cls(tokenizer, req, chat, echo if echo is None or isinstance(echo, str)
                   else tokenizer.decode(echo))

    def echoed_prompt(self) -> tuple[str, dict | None]:
        """The echoed text and, with ``logprobs``, its tokens' object ("", None: no echo)."""
        if self.echo is None:
            return "", None
        if self.k is None:
            return self.echo, None
        prompt = self.req.prompt_token_ids
        found = list(self.req.prompt_logprobs or [])[:len(prompt)]
        found += [None] * (len(prompt) - len(found))     # an aborted prefill: what there was
        return self.echo, completion_logprobs(self.text_of, prompt, found)[0]

    def output(self, i: int, ids: list[int], start: int, offset: int) -> tuple[dict | None, int]:
        """The logprobs object of choice ``i``'s tokens ``ids`` (from its token ``start``, text
        from character ``offset``) and the offset after them; None when not asked."""
        if self.k is None:
            return None, offset
        entries = (self.req.sample_logprobs(i) or [])[start:start + len(ids)]
        if self.chat:
            return {"content": chat_logprobs(self.text_of, ids, entries, self.k)}, offset
        return completion_logprobs(self.text_of, ids, entries, offset)

    def whole(self, i: int, ids: list[int]) -> tuple[str, dict | None]:
        """A finished choice: (echoed text, the logprobs object of the prompt and all ``ids``)."""
        echo, echo_lp = self.echoed_prompt()
        return echo, self.join(echo_lp, self.output(i, ids, 0, len(echo))[0])

    def take(self, i: int, ids: list[int]) -> tuple[str, dict | None]:
        """A stream's next chunk of choice ``i``: (echoed text if this is its first, the
        logprobs object of the echo and of ``ids``, the tokens the chunk delivers)."""
        echo, echo_lp = "", None
        if not self.echoed[i]:
            self.echoed[i] = True
            echo, echo_lp = self.echoed_prompt()
            self.offset[i] = len(echo)
        lp, self.offset[i] = self.output(i, ids, self.taken[i], self.offset[i])
        self.taken[i] += len(ids)
        return echo, self.join(echo_lp, lp)

    def join(self, echo_lp: dict | None, lp: dict | None) -> dict | None:
        """The echoed prompt's logprobs then the output's, as one object."""
        if echo_lp is None:
            return lp
        return merge_completion(echo_lp, lp) if lp is not None else echo_lp
