"""The reference server's FastAPI app: vLLM's weight-sync API plus the OpenAI surface.

``create_app`` only assembles route groups, each in its own module:

- ``weight_routes``: init / start / update / finish / shutdown and the weight checks;
- ``control_routes``: pause / resume / abort and the info routes (version, health, ...);
- here: ``/v1/completions`` and ``generate_on_a_replica``, which ``openai`` reuses for
  ``/v1/chat/completions``; ``sleep_routes``: vLLM's sleep mode.

Paths come from ``shared.routes.ROUTES``, shared with the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from weightwire.shared.routes import ROUTES
from weightwire.tools.server.auth import ApiKeyMiddleware
from weightwire.tools.server.completions import (
    CompletionRequest,
    CompletionRequestError,
    parse_completion_request,
)
from weightwire.tools.server.control_routes import install_control_routes
from weightwire.tools.server.openai import install_openai_routes, parse_generation
from weightwire.tools.server.replica import ReplicaError
from weightwire.tools.server.reply_size import check_reply_size
from weightwire.tools.server.state import SERVER_VERSION, ServerOptions, ServerState
from weightwire.tools.server.web import (
    ApiError,
    BodyLimitMiddleware,
    ClientGone,
    ReferenceApp,
    install_error_handlers,
)
from weightwire.tools.server.weight_routes import install_weight_routes

log = logging.getLogger(__name__)
__all__ = ["SERVER_VERSION", "ServerOptions", "ServerState", "create_app", "generate_on_a_replica"]


def create_app(state: ServerState) -> FastAPI:
    """The app serving ``state``: middlewares (API key outermost, before any body is read;
    then the body limit), error handlers, then every route group."""
    app = ReferenceApp(
        title="weightwire reference server", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.weightwire = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.options.max_body_bytes)
    app.add_middleware(
        ApiKeyMiddleware, api_key=state.options.api_key
    )  # outermost: before any body is read
    install_weight_routes(app, state)
    install_control_routes(app, state)
    _completion_routes(app, state)
    install_openai_routes(app, state, generate_on_a_replica)
    from weightwire.tools.server.sleep_routes import install_sleep_routes

    install_sleep_routes(app, state)
    from weightwire.tools.server.lora_routes import install_lora_routes

    install_lora_routes(app, state)
    return app


def _completion_routes(app: FastAPI, state: ServerState) -> None:
    opts = state.options

    @app.post(ROUTES["completions"].path)
    async def completions(request: Request) -> JSONResponse:
        req = await parse_generation(request, state, parse_completion_request)
        result, index = await generate_on_a_replica(state, req, request)
        result["model"] = req.model or opts.model_name
        return JSONResponse(result, headers={"x-weightwire-replica": str(index)})


async def generate_on_a_replica(
    state: ServerState,
    req: CompletionRequest,
    request: Request | None = None,
) -> tuple[dict[str, Any], int]:
    """Run one parsed completion request on a replica: reply-size bound, pause gate, replica
    choice, accounting. Returns the worker's ``text_completion`` result and the replica's
    index. If ``request``'s client disconnects first, the generation is cancelled on the
    worker (it stops at its next decode step) and nothing is answered."""
    opts, pool, gate = state.options, state.pool, state.gate
    info = pool.replicas[0].info
    try:
        check_reply_size(
            req,
            limit=opts.max_reply_bytes,
            piece_bytes=info.get("max_piece_bytes", 64),
            vocab_size=info["vocab_size"],
            max_model_len=info["max_model_len"],
        )
    except CompletionRequestError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    await gate.admit(opts.generate_timeout_s)
    try:
        replica = pool.pick()
    except ReplicaError as exc:
        raise ApiError(exc.status, str(exc)) from None
    replica.inflight_generations += 1
    gate.enter()
    try:
        call = replica.call(
            "generate", {"request": req.to_worker()}, timeout=opts.generate_timeout_s
        )
        result = await (call if request is None else _unless_disconnected(call, request))
    except ReplicaError as exc:
        raise ApiError(exc.status, str(exc)) from None
    finally:
        replica.inflight_generations -= 1
        gate.leave()
    return result, replica.index


async def _unless_disconnected(call: Coroutine[Any, Any, Any], request: Request) -> Any:
    """``call``'s result; cancelled (which cancels it on the worker) if the client leaves first."""
    work = asyncio.ensure_future(call)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, ReplicaError):
                await work
    if work.cancelled():
        log.info("%s: the client disconnected; its generation was cancelled", request.url.path)
        raise ClientGone(
            "the client disconnected before its completion was ready; the generation was cancelled"
        )
    return work.result()


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects. The body was read already, so the ASGI server's
    next message is the disconnect; anything else (a server that cannot tell) never
    cancels the request."""
    try:
        message = await request.receive()
    except Exception:  # no disconnect signal from this server: wait for the result
        message = {}
    if message.get("type") != "http.disconnect":
        await asyncio.Event().wait()
