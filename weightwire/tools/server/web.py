"""HTTP plumbing: error bodies, strict JSON bodies, the size limit, no tracebacks.

Every error reply has one shape, readable by OpenAI clients (``error.message``) and
by FastAPI-style clients (``detail``)::

    {"error": {"message": "...", "type": "...", "param": "init_info" | null, "code": 422},
     "detail": "..."}

A bug in a handler becomes a 500 that names the exception type only; the traceback
goes to the server log, never to the client.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.routing import Route

from weightwire.shared.errors import ReferenceServerError

log = logging.getLogger(__name__)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

DEFAULT_MAX_BODY_BYTES = 64 << 20
INLINE_PARSE_BYTES = 256 << 10
"""Bodies above this are parsed on a worker thread: a 64 MB update body takes seconds to
decode, and on the event loop that would stall every other request (``/health`` too)."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    500: "internal_error",
    502: "transfer_error",
    503: "unavailable_error",
    504: "timeout_error",
}


class ApiError(ReferenceServerError):
    """Raised by handlers; becomes an error reply with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.fields: dict[str, str] = {}
        """Keys the reply's ``"error"`` object carries beside its message, for a client to
        read instead of the message's words (``routes.START_PAUSE_FIELD``)."""


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
    fields: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": kind or _TYPES.get(status, "error"),
            "param": param,
            "code": status,
            **(fields or {}),
        },
        "detail": message,
    }
    return JSONResponse(body, status_code=status, headers=headers)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class ClientGone(ApiError):
    """The client closed the connection before sending its whole body (a trainer that
    aborted, a dropped connection), or before its answer was ready: nothing to answer
    and nothing worth a traceback."""

    def __init__(
        self, message: str = "the client disconnected before sending the whole request body"
    ) -> None:
        super().__init__(400, message, param="body")


async def read_json(request: Request) -> Any:
    """The parsed body, or ``None`` when it is empty. Non-UTF-8 / non-JSON -> 400."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        log.info("%s %s: the client disconnected mid-body", request.method, request.url.path)
        raise ClientGone() from None
    if len(raw) > INLINE_PARSE_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)


def parse_json(raw: bytes) -> Any:
    """``read_json``'s parser (pure; runs on a thread for big bodies)."""
    if not raw.strip():
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"request body is not valid UTF-8 (bad byte at offset {exc.start})", param="body"
        ) from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", param="body") from None
    # "\ud800" is a valid JSON escape but decodes to a lone surrogate, which no reply can
    # encode (stored as weight_version it breaks every later /weight_info). Only a body
    # holding such an escape pays for the full check.
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400,
                "request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), "
                "which is not valid Unicode text",
                param="body",
            ) from None
    return value


async def read_object(
    request: Request, *, allowed: Iterable[str], required: Iterable[str] = ()
) -> dict[str, Any]:
    """A JSON-object body with only ``allowed`` keys; missing required key -> 400, unknown ->
    422."""
    body = await read_json(request)
    allowed, required = set(allowed), list(required)
    if body is None:
        if required:
            raise ApiError(
                400,
                f"request body is empty; expected a JSON object with {required[0]!r}",
                param=required[0],
            )
        return {}
    if not isinstance(body, dict):
        raise ApiError(
            422, f"request body must be a JSON object, got {type(body).__name__}", param="body"
        )
    for key in required:
        if key not in body:
            raise ApiError(400, f"request body is missing the required field {key!r}", param=key)
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise ApiError(
            422,
            f"unknown field(s) {unknown}; this route accepts {sorted(allowed) or 'no body'}",
            param=unknown[0],
        )
    return body


def query_once(request: Request, name: str) -> str | None:
    """Query parameter ``name``'s value (None: absent); 422 when it is given more than once,
    since which one holds would be a guess (Starlette keeps the last: ``finish=true&finish=
    false`` was a plain update, ``pause=abort&pause=keep`` a keep, ``/sleep?level=1&level=2``
    a level 2 that discards the weights)."""
    given = request.query_params.getlist(name)
    if len(given) > 1:
        raise ApiError(
            422,
            f"query parameter {name} is given {len(given)} times ({given[:4]!r:.80}); give it once",
            param=name,
        )
    return given[0] if given else None


async def read_no_body(request: Request) -> None:
    """Routes that take no body accept nothing, ``null`` or ``{}``."""
    await read_object(request, allowed=())


class BodyTooLarge(ApiError):
    """A request body over ``--max-body-bytes``: a 413 reply, nothing is parsed."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes", param="body")


class BodyLimitMiddleware:
    """Pure ASGI: refuse bodies over ``max_bytes`` by header, and by count when streamed."""

    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            exc = (
                BodyTooLarge(self.max_bytes)
                if length.isdigit()
                else ApiError(400, "bad Content-Length header")
            )
            await error_response(exc.status, exc.message, param="body")(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)  # reaches the ApiError handler
            return message

        await self.app(scope, counted, send)


Endpoint = Callable[[Request], Awaitable[JSONResponse]]


def plain_post(app: FastAPI, path: str) -> Callable[[Endpoint], Endpoint]:
    """``@app.post(path)`` for a handler that takes the ``Request`` and builds its own
    ``JSONResponse``, as a plain Starlette route: FastAPI's per-request dependency solving
    and response handling have nothing to do for it and cost ~16 us a call (measured in
    process, 30 vs 14 us); the app's exception handlers and the 405 for another method
    apply as to any route. The round's routes (three calls a round) use it. On a
    ``ReferenceApp`` its POSTs are also answered ahead of FastAPI's middleware stack."""

    def register(endpoint: Endpoint) -> Endpoint:
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
        if isinstance(app, ReferenceApp):
            app.plain[path] = endpoint
        return endpoint

    return register


class ReferenceApp(FastAPI):
    """FastAPI, whose plain POST routes (``plain_post``: the weight round's) skip its own
    middleware stack: a POST to one of them goes through the app's user middlewares (the
    API key, the body limit), then straight to its handler, whose exceptions meet the app's
    exception handlers as in FastAPI's stack. What is skipped: the framework's error
    wrapper, its telemetry and body-limit layers, its exit stack and the router's scan;
    ~0.09 ms of a round's one request on the GPU hosts' Python (docs/benchmarks.md §22).
    Every other method or path, and every other route, takes FastAPI's own way."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plain: dict[str, Endpoint] = {}
        self._plain_stack: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.plain:
            if self._plain_stack is None:
                stack: Any = self._answer_plain
                for cls, args, kwargs in reversed(self.user_middleware):
                    stack = cls(stack, *args, **kwargs)
                self._plain_stack = stack
            scope["app"] = self
            await self._plain_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _answer_plain(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive, send)
        response: Response
        try:
            response = await self.plain[scope["path"]](request)
        except Exception as exc:
            handler = next(
                (
                    self.exception_handlers[t]
                    for t in type(exc).__mro__
                    if t in self.exception_handlers
                ),
                None,
            )
            if handler is None:  # not one of ours (install_error_handlers): FastAPI's way
                raise
            answer = handler(request, exc)
            response = await answer if inspect.isawaitable(answer) else answer
        await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, fields=exc.fields)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return error_response(422, f"{where}: {first.get('msg', 'invalid')}", param=where)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(
            500, f"internal server error ({type(exc).__name__}); details are in the server log"
        )
