"""What stands between the network and the handlers: the API key and the body-size limit.

Both are plain ASGI middleware, so they answer before FastAPI reads a byte of the body: a client
without the key, or with a body too big to be a prompt this model could take, costs the server
nothing but the answer. Both answer in OpenAI's error shape (``protocol.APIError``).
"""
from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response
from .protocol import APIError

# A JSON body holding a prompt of max_model_len tokens is far below this many bytes per token
# (a token id is at most 7 bytes with its comma; escaped text, \ud83d\ude00, 12 bytes a token):
# the default limit leaves a wide margin and still refuses a 50 MB body before reading it.
BODY_BYTES_PER_TOKEN = 128
MIN_BODY_BYTES = 1 << 20
OPEN_PATHS = {"/health"}     # a load balancer's probe needs no key


def default_max_body_bytes(max_model_len: int) -> int:
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def too_large(limit: int, size: int | None = None) -> APIError:
    size_is = f"is {size} bytes, " if size is not None else "is "
    return APIError(f"the request body {size_is}more than this server's limit of {limit} bytes "
                    "(serve --max-body-bytes)", 413, code="body_too_large")


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body without Content-Length grows past the limit: FastAPI
    re-raises an ``HTTPException`` met while reading the body, and ``errors.py`` answers it."""

    def __init__(self, limit: int):
        super().__init__(413, too_large(limit).message)


class BodyLimit:
    """Refuse a body over ``max_bytes`` with 413: at once from its Content-Length header, or,
    for a chunked body, as soon as the bytes received pass the limit (nothing more is read;
    uvicorn discards the rest of the upload, so the client still reads the answer)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = content_length(scope)
        if length is not None and length > self.max_bytes:
            return await error_response(too_large(self.max_bytes, length))(scope, receive, send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None   # the HTTP server itself refuses a malformed length
    return None


class RequireKey:
    """vLLM's ``--api-key``: every path but ``/health`` needs ``Authorization: Bearer KEY``; the
    dashboard (a page and an EventSource, which cannot set headers) may pass it as ``?key=KEY``
    instead. Keys are compared in constant time (``hmac.compare_digest``)."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.allowed(scope):
            return await self.app(scope, receive, send)
        e = APIError("a valid API key is required: send the header 'Authorization: Bearer <key>' "
                     "(the key given to serve --api-key)", 401, code="invalid_api_key")
        await error_response(e, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def allowed(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        if not given and scope["path"].startswith("/dashboard"):
            given = query_value(scope.get("query_string", b""), "key")
        return hmac.compare_digest(given, self.key)


def query_value(query: bytes, name: str) -> bytes:
    values = parse_qs(query.decode("latin-1")).get(name, [""])
    return values[0].encode("utf-8", "replace")
