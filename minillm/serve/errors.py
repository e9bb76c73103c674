"""Every failure the server can answer becomes OpenAI's error body.

``{"error": {"message", "type", "param", "code"}}`` is what the ``openai`` client parses; FastAPI's
own ``{"detail": ...}`` (bodies it cannot parse, unknown routes, wrong methods) and Starlette's
plain-text 500 would reach the client as unreadable errors. So this module installs a handler for
each: our ``APIError``, pydantic's validation errors, Starlette's ``HTTPException`` (404, whose
message lists every route the app serves; 405; and FastAPI's "error parsing the body", whose
cause names what was wrong) and any other exception (a generic 500 that names the exception
type, never a traceback).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .protocol import APIError

log = logging.getLogger("minillm.serve")

SUBFIELDS = {"role", "content", "text", "type", "include_usage"}
UNION_TYPE_ERRORS = {"string_type", "list_type", "int_type"}
UNION_HELP = {"prompt": "must be a string, or a list of token ids (integers)",
              "stop": "must be a string or a list of strings"}
HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
              413: "body_too_large"}


def error_response(e: APIError, headers: dict | None = None) -> JSONResponse:
    headers = {**({"Retry-After": "1"} if e.status == 429 else {}), **(headers or {})}
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, e: RequestValidationError):
        return error_response(validation_error(e))

    @app.exception_handler(HTTPException)
    async def http_error(http, e: HTTPException):
        return error_response(from_http_exception(e, http.method, http.url.path,
                                                  served_routes(http.app)),
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_, e: Exception):
        # Starlette logs the traceback after this handler answers: the client gets the shape
        # it can parse, the operator the details.
        return error_response(APIError(f"internal server error: {type(e).__name__}", 500))


def validation_error(e: RequestValidationError) -> APIError:
    """Pydantic's first complaint as a 400 naming the field (its path, e.g. ``messages.0.role``)."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: "
                        f"{err.get('ctx', {}).get('error', err['msg'])}")
    # the field's path, without pydantic's union-member tags ("prompt.str" -> "prompt")
    param = ".".join([*loc[:1], *(p for p in loc[1:] if p.isdigit() or p in SUBFIELDS)]) or None
    if err.get("type") in UNION_TYPE_ERRORS and param in UNION_HELP:
        return APIError(f"{param}: {UNION_HELP[param]}", param=param)
    if param is None:   # the body itself: not JSON, or not an object
        return APIError("the request body must be a JSON object (send Content-Type: "
                        "application/json)")
    got = f" (got {err['input']!r:.60})" if "input" in err and err["type"] != "missing" else ""
    return APIError(f"{param}: {err['msg']}{got}", param=param)


def served_routes(app) -> list[str]:
    """Every route ``app`` serves, as "METHOD /path": its API first, then FastAPI's own pages
    (/docs, /openapi.json...)."""
    routes = sorted(app.routes, key=lambda r: not isinstance(r, APIRoute))
    out = []
    for r in routes:
        methods = sorted(set(getattr(r, "methods", None) or ()) - {"HEAD"})
        out.append(f"{'/'.join(methods)} {r.path}".strip())
    return out


def from_http_exception(e: HTTPException, method: str, path: str,
                        routes: list[str] = ()) -> APIError:
    """Starlette's and FastAPI's HTTP errors, said in OpenAI's shape (``routes``: what a 404
    lists, ``served_routes``)."""
    if e.status_code == 404:
        return APIError(f"no such route: {method} {path} (this server serves "
                        f"{', '.join(routes)})", 404, code="not_found")
    if e.status_code == 405:
        allowed = (getattr(e, "headers", None) or {}).get("Allow", "")
        return APIError(f"method {method} is not allowed on {path}"
                        + (f" (use {allowed})" if allowed else ""), 405, code="method_not_allowed")
    if e.status_code == 400 and e.__cause__ is not None:
        return APIError(unparseable_body(e.__cause__))
    detail = e.detail if isinstance(e.detail, str) else str(e.detail)
    return APIError(detail, e.status_code, code=HTTP_CODES.get(e.status_code))


def unparseable_body(cause: BaseException) -> str:
    """Why ``json.loads`` refused the body (FastAPI only says "There was an error parsing")."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} "
                f"at offset {cause.start})")
    if isinstance(cause, RecursionError):
        return "the request body is not valid JSON: it is nested too deeply"
    if isinstance(cause, ValueError):   # e.g. an integer literal too long to convert
        why = str(cause).split(";")[0]     # (not Python's advice to raise its own limit)
        return f"the request body is not valid JSON: {why}"
    log.warning("unexpected body parsing error: %r", cause)
    return f"the request body could not be parsed ({type(cause).__name__})"
