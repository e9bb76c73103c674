"""The OpenAI-compatible HTTP server: ``create_app(llm)`` returns a FastAPI app.

    /v1/completions, /v1/chat/completions   streamed (server-sent events) or not
    /v1/models, /health, /metrics           (Prometheus text, vLLM's names)
    /dashboard                              the live batch view (``dashboard.py``)

A handler turns the body into a ``Request`` with the same code the offline ``LLM.generate`` uses
(``LLM.make_requests``: chat template, validation), submits it to the ``EngineLoop`` and turns the
token ids that come back into text (``IncrementalDetokenizer``). If the client goes away before the
end, the handler aborts its request, so its KV blocks go back to the pool at the next step.

Nothing slow runs on the asyncio event loop, which every client shares: a body bigger than any
prompt is refused before it is read (``guard.BodyLimit``), tokenizing, the chat template and
validation run on one worker thread (``prepare``), so a big prompt delays only its own answer,
and a structured-output grammar is parsed and compiled on threads of its own, within a time
bound (``grammar.py``), so a big grammar delays only its own answer too.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..llm import LLM
from ..request import Request, RequestError
from ..structured import GrammarState
from .answer import Answer, ClientGone, DisconnectWatch
from .logprobs import AnswerLogprobs
from .errors import add_error_handlers
from .grammar import COMPILE_TIMEOUT_S, GrammarWorker
from .guard import BodyLimit, RequireKey, default_max_body_bytes
from .loop import EngineFailed, EngineLoop, QueueFull, ShuttingDown
from .metrics import ServerMetrics, scrape
from .lora import load_adapters, model_cards, resolve_model
from .tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .responses import new_id


def create_app(llm: LLM, model_name: str | None = None, max_waiting: int = 64,
               dashboard: bool = True, api_key: str | None = None,
               max_body_bytes: int | None = None, engine_threads: int | None = None,
               lora_modules: dict | None = None,
               grammar_timeout_s: float = COMPILE_TIMEOUT_S) -> FastAPI:
    """The server for ``llm`` (its engine must support abort: 'paged' or 'dynamic'). The engine
    loop starts and stops with the app (its lifespan); ``app.state.loop`` is the ``EngineLoop``.
    ``api_key``: every route but /health needs it; ``max_body_bytes``: bigger bodies get a 413
    (default: ``guard.default_max_body_bytes`` of the model's context); ``engine_threads``:
    torch threads of the engine loop (``EngineLoop``'s ``threads``); ``lora_modules``: adapters
    by name, read now, that a request's ``model`` picks (``serve/lora.py``);
    ``grammar_timeout_s``: how long a request waits for its grammar to compile (``grammar.py``)
    before a 400."""
    name = model_name or llm.model.name
    loop = EngineLoop(llm.engine, ServerMetrics(name), max_waiting, threads=engine_threads)
    # One thread for tokenizing: Hugging Face's fast tokenizers must not be called from several
    # threads at once (vLLM serializes them the same way), and one is plenty for small prompts.
    prep = ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenize")
    grammars = GrammarWorker(llm, grammar_timeout_s)

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
            grammars.shutdown()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.loop, app.state.llm, app.state.model_name = loop, llm, name
    app.state.prep, app.state.grammars = prep, grammars
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
    params, compiled = await app.state.grammars.params(body, 256 if chat else 16)
    req = await asyncio.get_running_loop().run_in_executor(
        app.state.prep, prepare, llm, loop, body, params, compiled)
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
    if req.grammar is not None:
        answer.failure_param = body.param_of(req.grammar.field)
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
        raise answer.error
    return answer.body(final=True)


def prepare(llm: LLM, loop: EngineLoop, body, params, compiled) -> Request:
    """Text -> token ids (the chat template too) and the engine's checks: the per-token work,
    run on the tokenizer thread. ``compiled``: the request's grammar, compiled already
    (``grammar.py``), or None. A request that can never run is a 400 naming the field that
    makes it so (``RequestError.field``), else its prompt."""
    field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    req = llm.make_requests([body.prompt_input()], params)[0]
    if req.error:
        raise APIError(req.error, param=field)
    if compiled is not None:
        req.grammar = GrammarState(compiled, params.structured_outputs.field)
    try:
        loop.engine.validate(req)   # reads only fixed facts (vocabulary, context, pool size)
    except RequestError as e:
        raise APIError(str(e).removeprefix(f"{req.request_id}: "),
                       param=body.param_of(e.field) if e.field else field) from None
    return req
