"""What stands between the network and the handlers: the Host check, the API key, the body-size
limit, and the bounds on connections.

The first three are plain ASGI middleware, so they answer before FastAPI reads a byte of the
body: a request for another host name (DNS rebinding), a client without the key, or a body too big
to be a prompt this model could take, costs the server nothing but the answer, in OpenAI's error
shape (``protocol.APIError``). The connection bounds live one level lower, in uvicorn's HTTP
protocol (``connection_limits``): a client that never finishes its request head is closed after
``header_timeout_s``, and at most ``max_connections`` are served at once.
"""
from __future__ import annotations

import hmac
import logging
import re
from urllib.parse import parse_qs

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

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
# The names a server on the loopback interface is reached by; a server bound to every interface
# (0.0.0.0, ::) is meant to be reached by any name: it accepts every Host unless told otherwise.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
ALL_INTERFACES = ("0.0.0.0", "[::]")
# an --allowed-hosts item: a DNS name or an IPv4 address, or an IPv6 one in brackets, each with or
# without a port; or a bare IPv6 address
HOST_ITEM = re.compile(r"(?:[a-z0-9_.-]+|\[[0-9a-f:.]+\])(?::\d{1,5})?|[0-9a-f:.]+")
log = logging.getLogger("minillm.serve")


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


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


# --- the Host check (DNS rebinding) -------------------------------------------------------------
def host_name(value: str) -> str:
    """A Host header's, a ``--host``'s or an ``--allowed-hosts`` item's name, as compared: lower
    case, no port, no final dot, an IPv6 address in brackets ('LocalHost.:8000' -> 'localhost',
    '[::1]:8000' and '::1' -> '[::1]')."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[:v.find("]") + 1] or v
    if v.count(":") > 1:       # a bare IPv6 address (a --host; a Host header brackets it)
        return f"[{v}]"
    return v.split(":", 1)[0].rstrip(".")


def allowed_hosts(host: str, extra: str | None = None) -> frozenset[str] | None:
    """The names the server answers to (None: any): the loopback names and ``host`` (the address
    it listens on), plus ``extra`` (``serve --allowed-hosts``: a comma list; ``*``: any name). A
    server on every interface (``0.0.0.0``, ``::``) answers any name unless ``extra`` names some.
    Ports are not compared (a tunnel or a port forward changes them). A ValueError names a bad
    item."""
    items = [] if extra is None else [x.strip() for x in extra.split(",") if x.strip()]
    if extra is not None and not items:
        raise ValueError(f"--allowed-hosts must name at least one host (or *), got {extra!r}")
    if "*" in items:
        return None
    for item in items:
        if not HOST_ITEM.fullmatch(item.lower()):
            raise ValueError(f"--allowed-hosts item {item!r} is not a host name or an address")
    names = {host_name(item) for item in items}
    bound = host_name(host)
    if bound in ALL_INTERFACES and not names:
        return None
    return frozenset({*LOOPBACK_HOSTS, bound, *names} - set(ALL_INTERFACES))


class AllowedHosts:
    """Serve only requests whose ``Host`` header names this server (``allowed_hosts``): 421
    (Misdirected Request) otherwise. A page on another site that rebinds its own domain to
    127.0.0.1 (DNS rebinding) reaches the server from the user's browser with that domain in
    ``Host``: without this check it could read every answer and the dashboard. A request with no
    Host header at all (HTTP/1.0; a browser always sends one) is served."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str]):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = header(scope, b"host") if scope["type"] == "http" else None
        if host is None or host_name(host) in self.hosts:
            return await self.app(scope, receive, send)
        e = APIError(f"this server does not answer to the host name in the Host header, "
                     f"{host[:100]!r} (serve --allowed-hosts adds names it answers to)", 421,
                     code="misdirected_request")
        await error_response(e)(scope, receive, send)


# --- the connection bounds (slowloris) ----------------------------------------------------------
class HeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol, but a connection that has not sent a whole request head (the
    request line and every header) ``header_timeout_s`` after it opened, or after the first byte
    of its next request, is closed: uvicorn by itself waits for a head forever, and a client that
    opens connections and trickles bytes (slowloris) would hold them all. The bound is on the
    whole head, not between bytes, so trickling does not extend it. Once the head is in, the body
    and the answer take as long as they take; an idle keep-alive connection is uvicorn's
    ``timeout_keep_alive``."""

    header_timeout_s: float      # set by ``connection_limits``

    def connection_made(self, transport) -> None:
        self.head_timer = None
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _watch_head(self) -> None:
        if not self._awaiting_head():
            self._stop_watching()
        elif self.head_timer is None:
            self.head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _stop_watching(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self._awaiting_head():
            log.info("closed a connection from %s: no whole request head within %g s "
                     "(serve --header-timeout-s)", self.client, self.header_timeout_s)
            self.transport.close()


def connection_limits(header_timeout_s: float, max_connections: int) -> dict:
    """``uvicorn.Config`` options bounding connections: ``HeaderTimeout`` with
    ``header_timeout_s``, and at most ``max_connections`` served at once (a request on one more
    gets uvicorn's 503)."""
    protocol = type("HeaderTimeoutH11", (HeaderTimeout,), {"header_timeout_s": header_timeout_s})
    # uvicorn answers 503 once its count of connections, the asking one included, reaches
    # limit_concurrency: one more than max_connections serves max_connections at once
    return {"http": protocol, "limit_concurrency": max_connections + 1}
