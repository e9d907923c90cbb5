"""vLLM's weight-sync routes on the reference server: the session and round calls, and the checks.

Each route validates its body with the ``shared`` dataclasses (422 naming the field),
checks the session rules (409 with the reason), then fans out to every replica and
waits for all of them (bounded); a replica's failure comes back naming the replica,
and a failed weight operation clears the session and says what survived (``_fail``).
A round holds a lease between calls (``_arm_lease``): a trainer that vanishes
mid-round has its round aborted instead of blocking the next init forever.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from weightwire import backends
from weightwire.shared.routes import CHECKER_ACTIONS, ROUTES, SESSION_HEADER
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.update_info import UpdateInfo
from weightwire.tools.server.replicas import FanOutError, ReplicaError, ReplicaPool
from weightwire.tools.server.session import Phase, SessionError
from weightwire.tools.server.state import ServerState
from weightwire.tools.server.web import ApiError, error_response, read_no_body, read_object

_MAX_VERSION_CHARS = 1024
INLINE_UPDATE_BYTES = 64 << 10
"""Update bodies up to this size are validated on the event loop (well under a millisecond
even for a few hundred tensors' metadata); bigger ones on a worker thread."""
_VERDICT_GRACE_S = 10.0
_WEIGHTS_STATE_S = 5.0  # a replica answers /weight_info's question from its reader thread, at once
"""How much longer than its own ``timeout_s`` the API waits for a worker's finish verdict:
the worker decides (commit or not) within ``timeout_s``; this only covers a wedged one."""

log = logging.getLogger(__name__)


def install_weight_routes(app: FastAPI, state: ServerState) -> None:
    """The session routes (init, shutdown), the round routes (start, update, finish) and
    the checks (weight_info, weight_checker, update_weight_version)."""

    @app.exception_handler(SessionError)
    async def _session_error(_: Request, exc: SessionError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    _session_routes(app, state)
    _round_routes(app, state)
    _check_routes(app, state)


def _session_routes(app: FastAPI, state: ServerState) -> None:
    opts, session, pool, lease = state.options, state.session, state.pool, state.lease

    @app.post(_route("init_weight_transfer_engine"))
    async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("init_info",), required=("init_info",))
        raw = body["init_info"]
        info = _init_info(state, raw)
        # Workers bound the rendezvous and warm-up by their own Timeouts (same environment
        # as ours); this backstop only has to outlast both.
        local = Timeouts.from_env()
        timeout = local.connect_s + local.warmup_s + 30.0
        _require_live(pool)
        async with session.operation("init_weight_transfer_engine"):
            if session.phase is Phase.ROUND:
                await _drop_stale_round(state)  # or refuse (409): a live round is never taken over
            lease.disarm()
            await _fan_out_or_fail(
                state,
                "init_weight_transfer_engine",
                "init",
                {"init_info": raw},
                timeout=timeout,
                abort_on_failure=True,
            )
            session_id = session.initialized(info)
        return {"message": "Weight transfer initialized", "session_id": session_id}

    @app.post(_route("shutdown_weight_transfer_engine"))
    async def shutdown_weight_transfer_engine(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        _owner(state, request, "shutdown_weight_transfer_engine", idempotent=True)
        session.check_shutdown()
        async with session.operation("shutdown_weight_transfer_engine"):
            lease.disarm()
            await _fan_out_or_fail(
                state, "shutdown_weight_transfer_engine", "shutdown", timeout=opts.op_timeout_s
            )
            session.shut_down()
        return {"message": "Weight transfer shut down"}


def _round_routes(app: FastAPI, state: ServerState) -> None:
    opts, session, pool, lease = state.options, state.session, state.pool, state.lease

    # The round's three routes return a JSONResponse built here: the same bytes FastAPI
    # would write for the dict, minus its response-model pass (jsonable_encoder and a
    # pydantic validation of every reply), which is a share of each call's fixed cost.
    @app.post(_route("start_weight_update"))
    async def start_weight_update(request: Request) -> JSONResponse:
        await read_no_body(request)
        _owner(state, request, "start_weight_update")
        session.check_start()
        if state.sleep.weights_asleep:
            raise SessionError(
                409,
                f"start_weight_update refused: the server is asleep (/sleep level "
                f"{state.sleep.level}) and its weights are not loaded; POST "
                "/wake_up?tags=weights before sending a round",
            )
        async with session.operation("start_weight_update"):
            await _fan_out_or_fail(
                state,
                "start_weight_update",
                "start",
                timeout=opts.op_timeout_s,
                abort_on_failure=True,
            )
            session.started()
            _arm_lease(state)
        return JSONResponse({"message": "Weight update started"})

    @app.post(_route("start_draft_weight_update"))
    async def start_draft_weight_update(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        raise ApiError(
            400,
            "this server has no speculative-decoding draft model, so there is no draft weight "
            "update to start; use /start_weight_update for the main model",
        )

    @app.post(_route("update_weights"))
    async def update_weights(request: Request) -> JSONResponse:
        body = await read_object(request, allowed=("update_info",), required=("update_info",))
        _owner(state, request, "update_weights")
        session.check_update()
        async with session.operation("update_weights"):
            lease.disarm()
            try:
                # A round's metadata can list a million names: validate off the event loop. A small
                # body (metadata reuse: empty lists) is checked in microseconds, less than the hop.
                if (
                    len(await request.body()) > INLINE_UPDATE_BYTES
                ):  # the body is cached: no second read
                    per = await asyncio.to_thread(
                        _parse_update_payload, body["update_info"], state.replicas
                    )
                else:
                    per = _parse_update_payload(body["update_info"], state.replicas)
            except ApiError as exc:
                # The trainer is already broadcasting: tear the group down so it fails fast.
                await pool.abort_all()
                session.failed(f"update_weights: {exc.message}")
                raise ApiError(
                    exc.status,
                    f"{exc.message}; the round was aborted, POST "
                    "/init_weight_transfer_engine to start again",
                    param=exc.param,
                ) from None
            results = await _fan_out_or_fail(
                state,
                "update_weights",
                "update",
                [{"update_info": p} for p in per],
                timeout=opts.round_timeout_s,
                abort_on_failure=True,
            )
            session.updated(results)
            _arm_lease(state)
        return JSONResponse({"message": "Weights updated", "replicas": results})

    @app.post(_route("finish_weight_update"))
    async def finish_weight_update(request: Request) -> JSONResponse:
        body = await read_object(request, allowed=("weight_version",))
        version = _version_field(body, "weight_version", optional=True)
        _owner(state, request, "finish_weight_update")
        session.check_finish()
        async with session.operation("finish_weight_update"):
            lease.disarm()
            # The worker itself gives up on the model lock after op_timeout (and then
            # commits nothing); our wait only has to outlast that verdict.
            replies = await _fan_out_or_fail(
                state,
                "finish_weight_update",
                "finish",
                {"timeout_s": opts.op_timeout_s},
                timeout=opts.op_timeout_s + _VERDICT_GRACE_S,
                abort_on_failure=True,
            )
            state.sleep.record(replies)
            empty = session.updates_in_round == 0
            session.closed_empty() if empty else session.committed(version)
        if empty:
            raise ApiError(
                409,
                "no weights were sent in this round (POST /update_weights before "
                f"/finish_weight_update): the round was closed and weight_version stays "
                f"{session.weight_version!r}",
            )
        return JSONResponse(
            {"message": "Weight update finished", "weight_version": session.weight_version}
        )


def _check_routes(app: FastAPI, state: ServerState) -> None:
    session = state.session

    @app.post(_route("update_weight_version"))
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("new_version",), required=("new_version",))
        version = _version_field(body, "new_version", optional=False)
        assert version is not None
        # A version names the weights served: never while a round is changing them, never
        # from a trainer whose session was replaced, never for weights sleep discarded.
        _owner(state, request, "update_weight_version")
        session.check_no_round("update_weight_version")
        if state.sleep.missing:
            raise SessionError(
                409,
                f"update_weight_version refused: /sleep?level=2 discarded the weights and "
                f"{state.sleep.missing} tensor(s) have not been sent since; send a full round "
                "(its finish_weight_update names the version)",
            )
        async with session.operation("update_weight_version"):
            session.weight_version = version
        log.info("weight_version set to %r by /update_weight_version", version)
        return {"success": True, "new_version": version}

    @app.get(_route("weight_info"))
    async def weight_info() -> dict[str, Any]:
        per = await _weights_state(state)
        incomplete = [r for r in per if r.get("round_incomplete")]
        return {
            "weight_version": session.weight_version,
            "session": session.describe(),
            "round_incomplete": bool(incomplete),
            "incomplete_reason": incomplete[0].get("reason") if incomplete else None,
            "replica_weights": per,
            "sleep": state.sleep.describe(),
        }

    @app.post(_route("weight_checker"))
    async def weight_checker(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("action", "baseline"), required=("action",))
        return await _check_weights(state, body["action"], body.get("baseline"))


async def _weights_state(state: ServerState) -> list[dict[str, Any]]:
    """Each replica's ``weights`` answer (answered by its reader thread at once, even mid-round);
    a replica that cannot answer is reported, never a reason to fail the route."""

    async def one(replica: Any) -> dict[str, Any]:
        try:
            return dict(await replica.call("weights", timeout=_WEIGHTS_STATE_S))
        except ReplicaError as exc:
            return {"round_incomplete": None, "reason": str(exc)}

    return list(await asyncio.gather(*(one(r) for r in state.pool.replicas)))


async def _check_weights(state: ServerState, action: Any, baseline: Any) -> dict[str, Any]:
    """``/weight_checker``: per-replica checksums, a comparison with ``baseline``, or a reset."""
    session, pool, opts = state.session, state.pool, state.options
    if action not in CHECKER_ACTIONS:
        raise ApiError(
            422,
            f"action must be one of {list(CHECKER_ACTIONS)}, got {action!r:.60}",
            param="action",
        )
    if baseline is not None and not (
        isinstance(baseline, dict) and all(isinstance(v, str) for v in baseline.values())
    ):
        raise ApiError(
            422,
            "baseline must be an object mapping weight names to checksum strings",
            param="baseline",
        )
    if action == "reset":
        if session.phase is Phase.ROUND:
            raise SessionError(409, "cannot reset weights while a weight update is active")
        async with session.operation("weight_checker reset"):
            await _fan_out_or_raise(pool, "reset", opts.op_timeout_s)
        return {"status": "reset"}
    if action == "compare" and baseline is None:
        raise ApiError(400, "action='compare' requires a 'baseline' object", param="baseline")
    per_replica: list[dict[str, str]] = await _fan_out_or_raise(pool, "checksum", opts.op_timeout_s)
    if action == "checksum":
        return {
            "checksums": per_replica[0],
            "replica_checksums": per_replica,
            "consistent": all(c == per_replica[0] for c in per_replica),
        }
    assert baseline is not None
    per_mismatch = [
        sorted(k for k in c.keys() | baseline.keys() if c.get(k) != baseline.get(k))
        for c in per_replica
    ]
    mismatches = sorted(set().union(*per_mismatch))
    return {"match": not mismatches, "mismatches": mismatches, "replica_mismatches": per_mismatch}


# -- the rules the routes share ------------------------------------------------------------


def _route(name: str) -> str:
    return ROUTES[name].path


def _owner(state: ServerState, request: Request, route: str, *, idempotent: bool = False) -> None:
    state.session.check_owner(request.headers.get(SESSION_HEADER), route, idempotent=idempotent)


def _init_info(state: ServerState, raw: Any) -> Any:
    """The backend's init info parsed from ``raw`` (422 naming the field), sized for this server."""
    if not isinstance(raw, dict):
        raise ApiError(
            422, f"init_info must be a JSON object, got {type(raw).__name__}", param="init_info"
        )
    try:
        info = backends.init_info_type(state.options.backend).from_dict(raw)
    except ValueError as exc:
        raise ApiError(422, f"init_info: {exc}", param="init_info") from None
    if info.rank_offset + state.replicas > info.world_size:
        raise ApiError(
            422,
            (
                f"init_info.world_size {info.world_size} is too small: this server's "
                f"{state.replicas} worker(s) take ranks "
                f"{info.rank_offset}..{info.rank_offset + state.replicas - 1} (GET "
                "/get_world_size)"
            ),
            param="init_info.world_size",
        )
    return info


def _arm_lease(state: ServerState) -> None:
    """(Re)start the round lease after start / each update returned."""
    opts, session, pool = state.options, state.session, state.pool
    seconds = opts.lease_s
    if seconds is None:
        raw = getattr(session.init_info, "timeout_s", None)
        seconds = float(raw) if isinstance(raw, (int, float)) else Timeouts.from_env().transfer_s
    round_id = session.round_id

    async def expire() -> None:
        if (
            session.phase is not Phase.ROUND
            or session.round_id != round_id
            or session.busy is not None
        ):
            return  # the round moved on (or an operation now decides its fate)
        async with session.operation("round lease"):
            reason = (
                f"round lease expired: the trainer sent no weight call for {seconds:g} s "
                "during its round; the round was aborted and weight_version "
                f"{session.weight_version!r} is still served"
            )
            await pool.abort_all()
            session.failed(
                reason
            )  # logs the round's end; after the await: state and busy change together

    state.lease.arm(seconds, expire)


async def _drop_stale_round(state: ServerState) -> None:
    """An init while a round is open: refuse (409) unless every replica's worker finds the
    round stale (its trainer closed the data link, or no call for the worker's lease);
    then record the round as dropped. The init that follows tears it down."""
    session, opts = state.session, state.options
    try:
        reasons = await state.pool.fan_out("round_stale", timeout=opts.op_timeout_s)
    except FanOutError as exc:
        raise ApiError(
            exc.status,
            f"init_weight_transfer_engine: cannot tell whether the open round is stale: {exc}",
        ) from None
    live = [i for i, r in enumerate(reasons) if not r]
    if live:
        raise SessionError(
            409,
            (
                f"init_weight_transfer_engine refused: {session.active_round()} is in progress "
                f"and its trainer is still connected (replica(s) {live}); a new trainer can init "
                "once that round finished, or once it is gone (its data link closed, or no "
                "weight call for the round lease, after which the server aborts the round "
                "itself)"
            ),
        )
    session.dropped(str(reasons[0]))


def _require_live(pool: ReplicaPool) -> None:
    """A dead worker never rejoins (no respawn): refuse at once instead of letting the
    live ones wait out a rendezvous it will never join."""
    dead = [r for r in pool.health() if not r["alive"]]
    if dead:
        raise ApiError(
            503,
            "; ".join(f"replica {r['replica']}: {r['error']}" for r in dead)
            + "; the reference server does not respawn workers: restart it",
        )


async def _fan_out_or_fail(
    state: ServerState,
    what: str,
    op: str,
    args: Any = None,
    *,
    timeout: float,
    abort_on_failure: bool = False,
) -> list[Any]:
    """Run a weight operation on every replica; on failure clear the session and raise
    the HTTP error that says what survived."""
    try:
        return await state.pool.fan_out(
            op, args, timeout=timeout, abort_on_failure=abort_on_failure
        )
    except FanOutError as exc:
        raise _fail(state, what, exc) from None


def _fail(state: ServerState, what: str, exc: FanOutError) -> ApiError:
    """Clear the session after a failed weight operation and describe what survived."""
    state.session.failed(f"{what}: {exc}")
    failed = {e.replica for e in exc.errors} | set(exc.aborted)
    ok = [r.index for r in state.pool.replicas if r.index not in failed]
    tail = (
        f"; the previous weights and weight_version {state.session.weight_version!r} are still "
        "served; POST /init_weight_transfer_engine to start a new session"
    )
    if what == "finish_weight_update" and ok:
        tail = (
            f"; replicas {ok} committed the new weights but {sorted(failed)} did not: replicas "
            "now differ (compare with /weight_checker); POST /init_weight_transfer_engine and "
            "resend"
        )
    return ApiError(exc.status, f"{what} failed: {exc}{tail}")


async def _fan_out_or_raise(pool: ReplicaPool, op: str, timeout: float) -> Any:
    try:
        return await pool.fan_out(op, timeout=timeout)
    except FanOutError as exc:
        raise ApiError(exc.status, f"{op} failed: {exc}") from None


def _parse_update_payload(payload: Any, replicas: int) -> list[dict[str, Any]]:
    """One validated update-info dict per replica (vLLM's single or per-worker list form)."""
    if isinstance(payload, list):
        if len(payload) != replicas:
            raise ApiError(
                422,
                f"update_info lists {len(payload)} entries but this server has "
                f"{replicas} worker(s); send one object, or one per worker",
                param="update_info",
            )
        items = payload
    elif isinstance(payload, dict):
        items = [payload] * replicas
    else:
        raise ApiError(
            422,
            f"update_info must be a JSON object or a list of them, got {type(payload).__name__}",
            param="update_info",
        )
    for i, item in enumerate(items if isinstance(payload, list) else items[:1]):
        where = f"update_info[{i}]" if isinstance(payload, list) else "update_info"
        try:
            UpdateInfo.from_dict(item)
        except ValueError as exc:
            raise ApiError(422, f"{where}: {exc}", param=where) from None
    return items


def _version_field(body: dict[str, Any], key: str, *, optional: bool) -> str | None:
    value = body.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > _MAX_VERSION_CHARS:
        raise ApiError(
            422,
            f"{key} must be a non-empty string of at most {_MAX_VERSION_CHARS} characters, "
            f"got {value!r:.60}",
            param=key,
        )
    return value
