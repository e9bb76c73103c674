"""The OpenAI-compatible HTTP server: ``create_app(llm)`` returns a FastAPI app.

    /v1/completions, /v1/chat/completions   streamed (server-sent events) or not
    /v1/models, /health, /metrics           (Prometheus text, vLLM's names)
    /dashboard                              the live batch view (``dashboard.py``)

A handler turns the body into a ``Request`` with the same code the offline ``LLM.generate`` uses
(``LLM.make_requests``: chat template, validation), submits it to the ``EngineLoop`` and turns the
token ids that come back into text (``IncrementalDetokenizer``). If the client goes away before the
end, the handler aborts its request, so its KV blocks go back to the pool at the next step.

Nothing slow runs on the asyncio event loop, which every client shares: a body bigger than any
prompt is refused before it is read (``guard.BodyLimit``), and tokenizing, the chat template and
validation run on one worker thread (``prepare``), so a big prompt delays only its own answer.
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..llm import LLM
from ..request import Request, RequestError
from .detok import IncrementalDetokenizer
from .logprobs import AnswerLogprobs
from .errors import add_error_handlers
from .guard import BodyLimit, RequireKey, default_max_body_bytes
from .loop import EngineFailed, EngineLoop, Event, QueueFull, ShuttingDown
from .metrics import ServerMetrics, scrape
from .lora import load_adapters, model_cards, resolve_model
from .tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, completion_body,
                       new_id, usage)

DISCONNECT_POLL_S = 0.5   # a non-streaming handler checks this often whether its client left


class ClientGone(Exception):
    pass


def create_app(llm: LLM, model_name: str | None = None, max_waiting: int = 64,
               dashboard: bool = True, api_key: str | None = None,
               max_body_bytes: int | None = None, engine_threads: int | None = None,
               lora_modules: dict | None = None) -> FastAPI:
    """The server for ``llm`` (its engine must support abort: 'paged' or 'dynamic'). The engine
    loop starts and stops with the app (its lifespan); ``app.state.loop`` is the ``EngineLoop``.
    ``api_key``: every route but /health needs it; ``max_body_bytes``: bigger bodies get a 413
    (default: ``guard.default_max_body_bytes`` of the model's context); ``engine_threads``:
    torch threads of the engine loop (``EngineLoop``'s ``threads``); ``lora_modules``: adapters
    by name, read now, that a request's ``model`` picks (``serve/lora.py``)."""
    name = model_name or llm.model.name
    loop = EngineLoop(llm.engine, ServerMetrics(name), max_waiting, threads=engine_threads)
    # One thread for tokenizing: Hugging Face's fast tokenizers must not be called from several
    # threads at once (vLLM serializes them the same way), and one is plenty for small prompts.
    prep = ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm.engine.observers.add(loop.metrics.observe, ("transferred",))   # rung 11's KV moves
        loop.start()
        try:
            yield
        finally:
            loop.shutdown()
            llm.engine.observers.remove(loop.metrics.observe)
            prep.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.loop, app.state.llm, app.state.model_name = loop, llm, name
    app.state.prep = prep
    app.state.adapters = load_adapters(llm, lora_modules or {}, name)
    app.state.max_body_bytes = max_body_bytes or default_max_body_bytes(llm.model.max_model_len)
    app.add_middleware(BodyLimit, max_bytes=app.state.max_body_bytes)
    if api_key:   # added last: the outermost, so no key means no byte of the body is read
        app.add_middleware(RequireKey, key=api_key)
    add_error_handlers(app)
    if dashboard:
        from .dashboard import add_dashboard
        add_dashboard(app, loop, llm)

    @app.get("/health")
    async def health():
        if not loop.alive():
            raise APIError("the engine loop is not running", 503)
        if (why := loop.engine.health_error()) is not None:
            raise APIError(engine_failed_message(why), 503, code="engine_failed",
                           type="server_error")
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models():
        return model_cards(name, app.state.adapters, llm.model.max_model_len)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(loop.metrics.render(*scrape(loop)),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await serve(app, body, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await serve(app, body, http, chat=True)

    @app.post("/tokenize")        # vLLM's paths and shapes (tokenize.py)
    async def tokenize_(body: TokenizeRequest):
        resolve_model(body.model, app.state.model_name, app.state.adapters)
        return await asyncio.get_running_loop().run_in_executor(app.state.prep, tokenize, llm, body)

    @app.post("/detokenize")
    async def detokenize_(body: DetokenizeRequest):
        resolve_model(body.model, app.state.model_name, app.state.adapters)
        return await asyncio.get_running_loop().run_in_executor(app.state.prep, detokenize, llm,
                                                                body)

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


def engine_failed_message(why: str) -> str:
    return (f"the engine failed and cannot serve any more requests: restart the server "
            f"(cause: {why})")


async def serve(app: FastAPI, body, http: HTTPRequest, chat: bool):
    llm: LLM = app.state.llm
    loop: EngineLoop = app.state.loop
    lora = resolve_model(body.model, app.state.model_name, app.state.adapters)
    body.check_fields()
    stops = body.stop_strings()
    params = body.sampling_params(default_max_tokens=256 if chat else 16,
                                  vocab_size=llm.model.config.vocab_size)
    field = "messages" if chat else "prompt"
    req = await asyncio.get_running_loop().run_in_executor(
        app.state.prep, prepare, llm, loop, body.prompt_input(), params, field)
    req.request_id, req.priority = new_id("chatcmpl" if chat else "cmpl"), body.priority
    req.ttft_slo_ms, req.tpot_slo_ms = body.ttft_slo_ms, body.tpot_slo_ms    # rung 12
    req.lora_request = lora                                                  # rung 13
    try:
        events = loop.submit(req, validated=True)
    except ShuttingDown as e:
        raise APIError(str(e), 503, code="shutting_down") from None
    except EngineFailed as e:
        raise APIError(engine_failed_message(str(e)), 503, code="engine_failed",
                       type="server_error") from None
    except QueueFull as e:
        raise APIError(str(e), 429, code="queue_full", type="rate_limit_error") from None
    answer = Answer(llm, req, stops, chat, body.model)     # the base model or an adapter
    answer.return_token_ids = body.return_token_ids
    answer.extras = AnswerLogprobs.asked(llm.tokenizer, req, chat, body.echo_prompt())
    answer.hide_output = not chat and body.num_output_tokens(16) == 0   # the prompt only
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


def prepare(llm: LLM, loop: EngineLoop, prompt, params, field: str) -> Request:
    """Text -> token ids (the chat template too) and the engine's checks: the per-token work,
    run on the tokenizer thread. A request that can never run is a 400 naming ``field``."""
    req = llm.make_requests([prompt], params)[0]
    if req.error:
        raise APIError(req.error, param=field)
    try:
        loop.engine.validate(req)   # reads only fixed facts (vocabulary, context, pool size)
    except RequestError as e:
        msg = str(e).removeprefix(f"{req.request_id}: ")
        named = msg.split("=")[0]            # a field this engine refuses: "logprobs=3 is ..."
        param = ({"prompt_logprobs": "echo"}.get(named, named) if named in params.fields_in_use()
                 else "max_tokens" if "max_tokens" in msg else "n" if msg.startswith("n")
                 else field)
        raise APIError(msg, param=param) from None
    return req


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
        self.done, self.error = False, None
        self.extras: AnswerLogprobs | None = None   # echo and logprobs, when asked
        self.hide_output = False        # max_tokens 0: the engine's one token is not shown
        self.streaming = False

    def consume(self, event: Event) -> list[dict]:
        """Apply one event; return the choice deltas it produced (for a streamed chunk)."""
        deltas = []
        if event.kind == "error":
            self.done, self.error = True, event.error
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
