"""Token ids -> text, one token at a time, with stop strings (what a streaming server must add).

The engine stops on token ids; OpenAI's ``stop`` is *text*, and a stop string can span several
tokens or end in the middle of one. So each sample's text is decoded as it grows and searched for
the stop strings; what is sent to the client is held back while it could still be the start of a
stop string (it must never be sent and then "unsent"), or while it ends in an incomplete UTF-8
character (the tokenizer shows those as U+FFFD until the next token completes them).
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of one sample. ``add`` returns the new text that is safe to send."""

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.token_ids: list[int] = []
        self.text = ""          # decoded so far (cut at a stop string once one appears)
        self.sent = 0           # characters of ``text`` already handed out
        self.stopped = False    # a stop string appeared: no more text, ever

    def add(self, token_ids: list[int]) -> str:
        if self.stopped or not token_ids:
            return ""
        self.token_ids += token_ids
        # Decoding the whole sample each time is O(n^2) but simple and always right, even for
        # tokenizers whose spacing depends on the neighbours; outputs here are short.
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        # a trailing U+FFFD may be half a character: it cannot match a stop string yet
        self.text = text
        self._cut(len(text.rstrip(REPLACEMENT)))
        return self._take(len(self.text) if self.stopped else self._safe_end(self.text))

    def flush(self) -> str:
        """At the end of the sample: everything not sent yet (a trailing U+FFFD included)."""
        if not self.stopped:
            self._cut(len(self.text))
        return self._take(len(self.text))

    def _cut(self, searchable: int) -> None:
        """Cut the text at the earliest stop string within its first ``searchable`` chars."""
        cut = self._find_stop(self.text[:searchable])
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True

    def _take(self, end: int) -> str:
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        return delta

    def _find_stop(self, text: str) -> int | None:
        """Where the earliest stop string starts (only text not yet searched, plus an overlap)."""
        if not self.stops:
            return None
        start = max(0, self.sent - max(map(len, self.stops)))
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self, text: str) -> int:
        end = safe = len(text.rstrip(REPLACEMENT))
        for s in self.stops:   # the longest tail that is the start of a stop string stays back
            for k in range(min(len(s) - 1, end), 0, -1):
                if text.endswith(s[:k], 0, end):
                    safe = min(safe, end - k)
                    break
        return safe
