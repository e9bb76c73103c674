"""The OpenAI-compatible HTTP server: ``create_app(llm)`` returns a FastAPI app.

    /v1/completions, /v1/chat/completions   streamed (server-sent events) or not
    /v1/models, /health, /metrics           (Prometheus text, vLLM's names)
    /dashboard                              the live batch view (``dashboard.py``)

A handler turns the body into a ``Request`` with the same code the offline ``LLM.generate`` uses
(``LLM.make_requests``: chat template, validation), submits it to the ``EngineLoop`` and turns the
token ids that come back into text (``IncrementalDetokenizer``). If the client goes away before the
end, the handler aborts its request, so its KV blocks go back to the pool at the next step.
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..llm import LLM
from ..request import FinishReason, Request, RequestError
from .detok import IncrementalDetokenizer
from .loop import EngineLoop, Event, QueueFull, ShuttingDown
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, completion_body,
                       new_id, usage)

DISCONNECT_POLL_S = 0.5   # a non-streaming handler checks this often whether its client left


class ClientGone(Exception):
    pass


def create_app(llm: LLM, model_name: str | None = None, max_waiting: int = 64,
               dashboard: bool = True) -> FastAPI:
    """The server for ``llm`` (its engine must support abort: 'paged' or 'dynamic'). The engine
    loop starts and stops with the app (its lifespan); ``app.state.loop`` is the ``EngineLoop``."""
    name = model_name or llm.model.name
    loop = EngineLoop(llm.engine, ServerMetrics(name), max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.shutdown()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.loop, app.state.llm, app.state.model_name = loop, llm, name
    add_error_handlers(app)
    if dashboard:
        from .dashboard import add_dashboard
        add_dashboard(app, loop, llm)

    @app.get("/health")
    async def health():
        if not loop._thread.is_alive():
            raise APIError("the engine loop is not running", 503)
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "minillm",
                                            "max_model_len": llm.model.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        kv, eng = loop.kv, loop.engine
        gauges = {"vllm:num_requests_running": loop.num_running(),
                  "vllm:num_requests_waiting": loop.num_waiting(),
                  "vllm:kv_cache_usage_perc": (kv.allocated / kv.total) if kv.total else 0.0}
        counters = {"vllm:num_preemptions_total": eng.num_preemptions,
                    "vllm:prefix_cache_hits_total": eng.prefix_hit_tokens,
                    "minillm:engine_steps_total": loop.step_count,
                    "minillm:engine_step_seconds_total": loop.engine_step_s,
                    "minillm:loop_overhead_seconds_total": loop.overhead_s}
        return PlainTextResponse(loop.metrics.render(gauges, counters),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await serve(app, body, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await serve(app, body, http, chat=True)

    return app


class StoppingServer(uvicorn.Server):
    """uvicorn's server for ``create_app``, but stopping it (Ctrl-C, ``stop()``) first stops the
    engine loop: every request in flight ends at once with a "shutting down" error, so its stream
    closes instead of holding the shutdown for ``timeout_graceful_shutdown``; dashboards too."""

    def stop(self) -> None:
        self.config.app.state.loop.stop()
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        self.config.app.state.loop.stop()
        super().handle_exit(sig, frame)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return await api_error(None, APIError(f"the request body is not valid JSON: "
                                            f"{err.get('ctx', {}).get('error', err['msg'])}"))
        # the field's path, without pydantic's union-member tags ("prompt.str" -> "prompt")
        param = ".".join([*loc[:1], *(p for p in loc[1:] if p.isdigit() or p in SUBFIELDS)]) or None
        if err.get("type") in UNION_TYPE_ERRORS and param in UNION_HELP:
            return await api_error(None, APIError(f"{param}: {UNION_HELP[param]}", param=param))
        if param is None:   # the body itself: not JSON, or not an object
            return await api_error(None, APIError("the request body must be a JSON object "
                                                  "(send Content-Type: application/json)"))
        got = f" (got {err['input']!r:.60})" if "input" in err and err["type"] != "missing" else ""
        return await api_error(None, APIError(f"{param or 'body'}: {err['msg']}{got}", param=param))


SUBFIELDS = {"role", "content", "text", "type", "include_usage"}
UNION_TYPE_ERRORS = {"string_type", "list_type", "int_type"}
UNION_HELP = {"prompt": "must be a string, or a list of token ids (integers)",
              "stop": "must be a string or a list of strings"}


async def serve(app: FastAPI, body, http: HTTPRequest, chat: bool):
    llm: LLM = app.state.llm
    loop: EngineLoop = app.state.loop
    if body.model != app.state.model_name:
        raise APIError(f"model {body.model!r} does not exist: this server serves "
                       f"{app.state.model_name!r}", param="model", code="model_not_found")
    body.check_unsupported()
    stops = body.stop_strings()
    params = body.sampling_params(default_max_tokens=256 if chat else 16)
    req = llm.make_requests([body.prompt_input()], params)[0]
    field = "messages" if chat else "prompt"
    if req.error:
        raise APIError(req.error, param=field)
    req.request_id = new_id("chatcmpl" if chat else "cmpl")
    try:
        events = loop.submit(req)
    except RequestError as e:
        msg = str(e).removeprefix(f"{req.request_id}: ")
        param = "max_tokens" if "max_tokens" in msg else "n" if msg.startswith("n") else field
        raise APIError(msg, param=param) from None
    except ShuttingDown as e:
        raise APIError(str(e), 503, code="shutting_down") from None
    except QueueFull as e:
        raise APIError(str(e), 429, code="queue_full", type="rate_limit_error") from None
    answer = Answer(llm, req, stops, chat, app.state.model_name)
    answer.return_token_ids = body.return_token_ids
    if body.stream:
        return StreamingResponse(answer.stream(events, loop, body.include_usage),
                                 media_type="text/event-stream")
    watch = DisconnectWatch(http)
    try:
        while not answer.done:
            answer.consume(await watch.next_event(events))
            if answer.all_stopped and not answer.done:
                loop.abort(req.request_id)   # every choice hit a stop string
    except ClientGone:
        loop.abort(req.request_id)
        return JSONResponse({}, status_code=499)   # nobody reads it: nginx's "client closed"
    except BaseException:
        loop.abort(req.request_id)
        raise
    if answer.error:
        raise APIError(answer.error, 500)
    return answer.body(final=True)


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
        self.max_model_len = llm.model.max_model_len
        self.detoks = [IncrementalDetokenizer(llm.tokenizer, stops) for _ in range(req.params.n)]
        self.finish: list[str | None] = [None] * req.params.n
        self.done, self.error = False, None

    def consume(self, event: Event) -> list[dict]:
        """Apply one event; return the choice deltas it produced (for a streamed chunk)."""
        deltas = []
        if event.kind == "error":
            self.done, self.error = True, event.error
            return deltas
        for i, ids in sorted(event.tokens.items()):
            if self.finish[i] is None:
                text = self.detoks[i].add(ids)
                if self.detoks[i].stopped:
                    self.finish[i] = "stop"
                if text or self.finish[i]:
                    deltas.append({"index": i, "text": text, "finish_reason": self.finish[i]})
        if event.kind == "done":
            self.done = True
            for i, d in enumerate(self.detoks):
                if self.finish[i] is None:
                    self.finish[i] = self._reason(d)
                    deltas.append({"index": i, "text": d.flush(), "finish_reason": self.finish[i]})
        return deltas

    def _reason(self, d: IncrementalDetokenizer) -> str:
        n = len(d.token_ids)
        if n >= self.req.params.max_tokens or self.req.prompt_len + n >= self.max_model_len:
            return "length"
        return "abort" if self.req.finish_reason == FinishReason.ABORT else "stop"

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
        return completion_body(self.req.request_id, self.model, self.chat, choices,
                               self.usage() if final else None, chunk=not final)

    async def stream(self, events: asyncio.Queue, loop: EngineLoop, include_usage: bool):
        """Server-sent events: one chunk per step that produced text, then ``[DONE]``. Runs until
        the request ends; if the client disconnects, Starlette cancels it and ``finally`` aborts."""
        try:
            if self.chat:   # OpenAI's first chunk names the role
                yield sse(self.body(False, [{"index": i, "text": "", "first": True}
                                            for i in range(len(self.detoks))]))
            while not self.done:
                deltas = self.consume(await events.get())
                if self.error:
                    yield sse(APIError(self.error, 500).body())
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
