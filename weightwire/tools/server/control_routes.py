"""The reference server's control routes beside weight sync: pause / resume / abort, the
cache resets, and what a client asks before a session (version, health, world size, server info).

Same paths, query parameters and replies as vLLM's dev-mode routes (``shared.routes``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from weightwire.shared.routes import PAUSE_BOUNDS, ROUTES
from weightwire.tools.server.after_commit import wait_bound_query
from weightwire.tools.server.replicas import FanOutError
from weightwire.tools.server.state import SERVER_VERSION, ServerState
from weightwire.tools.server.web import (
    ApiError,
    error_response,
    query_once,
    read_no_body,
    read_object,
)

_CANCEL_TIMEOUT_S = 30.0


def install_control_routes(app: FastAPI, state: ServerState) -> None:
    """``/pause``, ``/resume``, ``/is_paused``, ``/abort_requests`` and the info routes."""
    _pause_routes(app, state)
    _cache_routes(app)
    _info_routes(app, state)


def _pause_routes(app: FastAPI, state: ServerState) -> None:
    pool, gate = state.pool, state.gate

    @app.post(ROUTES["pause"].path)
    async def pause(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        mode = query_once(request, "mode")
        mode = "abort" if mode is None else mode
        _bool_query(request, "clear_cache", default=True)  # no KV cache outlives a request here
        bound = wait_bound_query(request, mode, "mode")  # advertised (PAUSE_BOUNDS)
        held, ours = gate.mode, gate.pauses + 1
        try:
            await pause_generation(state, mode, wait_s=bound)
        except ApiError as exc:
            # A wait that did not drain: the caller is told the pause failed, so it does not
            # stay (was: held, taking effect for a caller that gave up), unless another pause
            # or a resume came since.
            if gate.pauses == ours and gate.mode == mode:
                if held is None:
                    gate.resume()
                else:
                    gate.pause(held)
                exc.message += "; the pause was undone"
                if held is not None:
                    exc.message += f" (the pause held before it stays: mode={held})"
            raise
        return {"status": "paused"}

    @app.post(ROUTES["abort_requests"].path)
    async def abort_requests(request: Request) -> dict[str, Any]:
        # vLLM's route: abort in-flight requests without pausing; no ids = all of them.
        body = await read_object(request, allowed=("request_ids",))
        if body.get("request_ids"):
            raise ApiError(
                400,
                "this server aborts all in-flight requests at once; omit request_ids",
                param="request_ids",
            )
        aborted = sum(r.inflight_generations for r in pool.replicas)
        with contextlib.suppress(FanOutError):  # a dead replica has nothing in flight to cancel
            await pool.fan_out("cancel", timeout=_CANCEL_TIMEOUT_S)
        return {"status": "aborted", "aborted": aborted}

    @app.post(ROUTES["resume"].path)
    async def resume(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        if state.sleep.level is not None:
            # /resume lifts only a /pause: while asleep it would not resume generation.
            then = "that resumes generation"
            if gate.mode is not None:  # the /pause outlives the wake: say both steps
                then = f"then POST /resume again to lift the /pause (mode={gate.mode})"
            raise ApiError(
                503,
                f"the server is asleep (/sleep level {state.sleep.level}): POST /wake_up to wake "
                f"it ({then}); /resume lifts only a /pause",
            )
        gate.resume()
        return {"status": "resumed"}

    @app.get(ROUTES["is_paused"].path)
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": gate.paused}


async def pause_generation(
    state: ServerState, mode: str, *, ahead: bool = False, wait_s: float | None = None
) -> None:
    """What ``/pause?mode=`` does (also asked by a start: ``weight_routes``): hold the gate;
    ``abort`` cancels what runs, ``wait`` returns once it finished (bounded by
    ``--generate-timeout`` and, where the client gave it, ``wait_s``: the longest it waits for
    the answer, ``PAUSE_BOUNDS``; past it, 504; the caller undoes the pause it took).

    ``ahead`` (a start that pauses): the cancel is posted, not awaited: the start's own call
    follows it on each worker's pipe, so every worker takes the cancel first, as when its
    answer was awaited (a cancel is answered at once, on arrival: its answer says no more),
    and the start costs one worker round trip, not two."""
    gate = state.gate
    gate.pause(mode)
    if mode == "abort" and ahead:
        state.pool.post("cancel")
    elif mode == "abort":
        with contextlib.suppress(FanOutError):  # a dead replica has nothing in flight to cancel
            await state.pool.fan_out("cancel", timeout=_CANCEL_TIMEOUT_S)
    elif mode == "wait":
        bound = state.options.generate_timeout_s
        await gate.drain(bound if wait_s is None else min(bound, wait_s))


def _cache_routes(app: FastAPI) -> None:
    # vLLM's cache routes, answered truthfully: this server keeps no KV or encoder output
    # beyond one request, and a request runs under the model lock that a commit takes, so it
    # never spans a round. There is nothing computed with old weights to drop: success.

    @app.post(ROUTES["reset_prefix_cache"].path)
    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        _bool_query(request, "reset_running_requests", default=False)
        _bool_query(request, "reset_external", default=False)
        return {"success": True}

    @app.post(ROUTES["reset_encoder_cache"].path)
    async def reset_encoder_cache(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        return {"success": True}


def _info_routes(app: FastAPI, state: ServerState) -> None:
    opts, pool, gate = state.options, state.pool, state.gate

    @app.get(ROUTES["server_info"].path)
    async def server_info() -> dict[str, Any]:
        # The part of vLLM's dev-mode /server_info a trainer reads: the configured backend.
        return {
            "server": "weightwire-reference",
            "vllm_config": {"weight_transfer_config": {"backend": opts.backend}},
        }

    @app.get(ROUTES["get_world_size"].path)
    async def get_world_size(request: Request) -> dict[str, Any]:
        _bool_query(
            request, "include_dp", default=True
        )  # accepted; no TP here, so both answers agree
        return {"world_size": state.replicas}

    @app.get(ROUTES["version"].path)
    async def version() -> dict[str, Any]:
        # The server-wide features, for a client before any init (whose reply names them
        # too): a sleep or pause that waits, sent before it, is bounded all the same.
        return {"version": SERVER_VERSION, "features": [PAUSE_BOUNDS]}

    @app.get(ROUTES["health"].path)
    async def health() -> JSONResponse:
        """Every replica's liveness and generations in flight, and ``requests_held``: the
        completions waiting at the pause gate (``/pause?mode=keep`` or a sleep's keep) to run."""
        replicas = pool.health()
        dead = [r for r in replicas if not r["alive"]]
        if dead:
            return error_response(
                503, "; ".join(f"replica {r['replica']}: {r['error']}" for r in dead)
            )
        return JSONResponse({"replicas": replicas, "requests_held": gate.held})


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _bool_query(request: Request, name: str, *, default: bool) -> bool:
    raw = query_once(request, name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ApiError(
        422, f"query parameter {name} must be true or false, got {raw!r:.40}", param=name
    )
