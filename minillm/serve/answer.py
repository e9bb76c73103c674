"""One request's answer as the client sees it (``Answer``): the text of each choice, built from
the engine loop's events, whole or streamed as server-sent events; and how a non-streaming
handler notices that its client left (``DisconnectWatch``).

A request that ends with ``FinishReason.ERROR`` (a sample whose grammar reached a dead end: no
token allowed) is answered with an error for it alone: a 400 naming the grammar's field, or, in
a stream already under way, an error chunk.
"""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request as HTTPRequest

from ..llm import LLM
from ..request import FinishReason, Request
from .detok import IncrementalDetokenizer
from .logprobs import AnswerLogprobs
from .loop import EngineLoop, Event
from .protocol import APIError
from .responses import completion_body, usage

DISCONNECT_POLL_S = 0.5   # a non-streaming handler checks this often whether its client left


class ClientGone(Exception):
    pass


class DisconnectWatch:
    """A non-streaming handler learns that its client left only by asking (Starlette cancels a
    streaming response by itself): ask at most every ``DISCONNECT_POLL_S``, tokens or not."""

    def __init__(self, http: HTTPRequest):
        self.http, self.next_check = http, time.monotonic() + DISCONNECT_POLL_S

    async def next_event(self, events: asyncio.Queue) -> Event:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                event = None
            if time.monotonic() >= self.next_check:
                if await self.http.is_disconnected():
                    raise ClientGone()
                self.next_check = time.monotonic() + DISCONNECT_POLL_S
            if event is not None:
                return event


class Answer:
    """The client's view of one request: text per choice, built from the loop's events."""

    def __init__(self, llm: LLM, req: Request, stops: list[str], chat: bool, model: str):
        self.req, self.chat, self.model = req, chat, model
        self.return_token_ids = False
        self.detoks = [IncrementalDetokenizer(llm.tokenizer, stops) for _ in range(req.params.n)]
        self.finish: list[str | None] = [None] * req.params.n
        self.done = False
        self.error: APIError | None = None      # how the request failed, once it has
        self.failure_param: str | None = None    # the field a failed sample's grammar is in
        self.extras: AnswerLogprobs | None = None   # echo and logprobs, when asked
        self.hide_output = False        # max_tokens 0: the engine's one token is not shown
        self.streaming = False

    def consume(self, event: Event) -> list[dict]:
        """Apply one event; return the choice deltas it produced (for a streamed chunk)."""
        deltas = []
        if event.kind == "error":
            self.done, self.error = True, APIError(event.error, 500)
            return deltas
        if event.kind == "done" and self.req.finish_reason is FinishReason.ERROR:
            # a request that ran fails only when a sample's grammar allowed no next token
            self.done, self.error = True, APIError(self.req.error, 400, param=self.failure_param)
            return deltas
        for i, ids in sorted(event.tokens.items()):
            if self.finish[i] is None:
                before = len(self.detoks[i].token_ids)
                text = self.detoks[i].add([] if self.hide_output else ids)
                if self.detoks[i].stopped:
                    self.finish[i] = "stop"
                # with return_token_ids (or logprobs) every token is sent as it comes, even while
                # its text is held back (a possible stop string, half a character): the chunks'
                # ids add up to the unstreamed answer's token_ids
                added = self.detoks[i].token_ids[before:]
                if text or self.finish[i] or (added and (self.return_token_ids or self.extras)):
                    deltas.append(self._delta(i, text, added))
        if event.kind == "done":
            self.done = True
            for i, d in enumerate(self.detoks):
                if self.finish[i] is None:
                    self.finish[i] = "length" if self.hide_output else self._reason(i)
                    deltas.append(self._delta(i, d.flush(), []))
        return deltas

    def _delta(self, i: int, text: str, token_ids: list[int]) -> dict:
        delta = {"index": i, "text": text, "finish_reason": self.finish[i]}
        if self.return_token_ids:
            delta["token_ids"] = token_ids
        if self.extras is not None and self.streaming:   # a whole answer gets them at its end
            echo, delta["logprobs"] = self.extras.take(i, token_ids)
            delta["text"] = echo + text
        return delta

    def _reason(self, i: int) -> str:
        """Why sample ``i`` ended, as the engine committed it (``Request.outputs``)."""
        outputs = self.req.outputs
        reason = (outputs[i].finish_reason if i < len(outputs) else None) or self.req.finish_reason
        return reason.value

    @property
    def all_stopped(self) -> bool:
        return all(f is not None for f in self.finish)

    def usage(self) -> dict:
        return usage(self.req.prompt_len, sum(len(d.token_ids) for d in self.detoks))

    def body(self, final: bool, choices: list[dict] | None = None) -> dict:
        if final:
            choices = [{"index": i, "text": d.text, "finish_reason": self.finish[i]}
                       for i, d in enumerate(self.detoks)]
            if self.return_token_ids:
                for c, d in zip(choices, self.detoks):
                    c["token_ids"] = d.token_ids
            for c, d in zip(choices, self.detoks) if self.extras else ():
                echo, c["logprobs"] = self.extras.whole(c["index"], d.token_ids)
                c["text"] = echo + c["text"]
        return completion_body(self.req.request_id, self.model, self.chat, choices,
                               self.usage() if final else None, chunk=not final)

    async def stream(self, events: asyncio.Queue, loop: EngineLoop, include_usage: bool):
        """Server-sent events: one chunk per step that produced text, then ``[DONE]``. Runs until
        the request ends; if the client disconnects, Starlette cancels it and ``finally`` aborts."""
        self.streaming = True
        try:
            if self.chat:   # OpenAI's first chunk names the role
                yield sse(self.body(False, [{"index": i, "text": "", "first": True}
                                            for i in range(len(self.detoks))]))
            while not self.done:
                deltas = self.consume(await events.get())
                if self.error:
                    yield sse(self.error.body())
                    break
                if deltas:
                    yield sse(self.body(False, deltas))
                if self.all_stopped and not self.done:
                    loop.abort(self.req.request_id)   # every choice hit a stop string
            else:
                if include_usage:
                    chunk = completion_body(self.req.request_id, self.model, self.chat, [],
                                            self.usage(), chunk=True)
                    yield sse(chunk)
                yield "data: [DONE]\n\n"
        finally:
            if not self.done:
                loop.abort(self.req.request_id)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
