"""vLLM's weight-sync routes on the reference server: the session and round calls, and the checks.

Each route validates its body with the ``shared`` dataclasses (422 naming the field),
checks the session rules (409 with the reason), then fans out to every replica and
waits for all of them (bounded); a replica's failure comes back naming the replica,
and a failed weight operation clears the session and says what survived. The rules
the routes share (ownership, the round lease, fan-out and its failures, body fields)
are in ``weight_rules``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from weightwire._trace import dump_trace, trace
from weightwire.shared.routes import (
    CHECKER_ACTIONS,
    FINISH_RESETS_RESUMES,
    PAUSE_BOUNDS,
    SERVED_MODEL,
    START_KEPT_HELD,
    START_PAUSE_FIELD,
    START_PAUSE_HELD,
    START_PAUSE_NONE,
    START_PAUSE_UNDONE,
    START_PAUSED_NOTHING,
    START_PAUSES,
    START_UNDID_PAUSE,
    UPDATE_FINISHES,
    UPDATE_STARTS,
)
from weightwire.shared.timeouts import Timeouts
from weightwire.tools.server.after_commit import (
    StartAsked,
    after_commit,
    after_commit_query,
    pause_query,
    update_finish_query,
    update_start_query,
    wait_bound_query,
)
from weightwire.tools.server.call_clock import CallClock
from weightwire.tools.server.control_routes import pause_generation
from weightwire.tools.server.session import Phase, SessionError
from weightwire.tools.server.state import ServerState
from weightwire.tools.server.web import (
    ApiError,
    error_response,
    plain_post,
    read_no_body,
    read_object,
)
from weightwire.tools.server.weight_rules import (
    NothingToReuse,
    arm_lease,
    check_reuse,
    drop_stale_round,
    fan_out_or_fail,
    fan_out_or_raise,
    note_listing,
    parse_init_info,
    parse_update_payload,
    require_live,
    require_owner,
    route_path,
    version_field,
    weights_state,
)

INLINE_UPDATE_BYTES = 64 << 10
"""Update bodies up to this size are validated on the event loop (well under a millisecond
even for a few hundred tensors' metadata); bigger ones on a worker thread."""
_VERDICT_GRACE_S = 10.0
"""How much longer than its own ``timeout_s`` the API waits for a worker's finish verdict:
the worker decides (commit or not) within ``timeout_s``; this only covers a wedged one."""

log = logging.getLogger(__name__)


def install_weight_routes(app: FastAPI, state: ServerState) -> None:
    """The session routes (init, shutdown), the round routes (start, update, finish) and
    the checks (weight_info, weight_checker, update_weight_version)."""

    @app.exception_handler(SessionError)
    async def _session_error(_: Request, exc: SessionError) -> JSONResponse:
        return error_response(exc.status, exc.message, fields=exc.fields)

    _session_routes(app, state)
    _round_routes(app, state)
    _check_routes(app, state)


def _session_routes(app: FastAPI, state: ServerState) -> None:
    opts, session, pool, lease = state.options, state.session, state.pool, state.lease

    @app.post(route_path("init_weight_transfer_engine"))
    async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("init_info",), required=("init_info",))
        raw = body["init_info"]
        info = parse_init_info(state, raw)
        # Workers bound the rendezvous and warm-up by their own Timeouts (same environment
        # as ours); this backstop only has to outlast both.
        local = Timeouts.from_env()
        timeout = local.connect_s + local.warmup_s + 30.0
        require_live(pool)
        async with session.operation("init_weight_transfer_engine"):
            if session.phase is Phase.ROUND:
                await drop_stale_round(state)  # or refuse (409): a live round is never taken over
            lease.disarm()
            replies = await fan_out_or_fail(
                state,
                "init_weight_transfer_engine",
                "init",
                {"init_info": raw},
                timeout=timeout,
                abort_on_failure=True,
            )
            session_id = session.initialized(info)
        reply: dict[str, Any] = {
            "message": "Weight transfer initialized",
            "session_id": session_id,
            # the client uses only what is named here
            "features": [
                START_PAUSES,
                FINISH_RESETS_RESUMES,
                UPDATE_FINISHES,
                UPDATE_STARTS,
                PAUSE_BOUNDS,
            ],
        }
        # every replica loads the one model directory: the first one's says it for all
        served = replies[0].get(SERVED_MODEL) if replies and isinstance(replies[0], dict) else None
        if served is not None:
            reply["features"].append(SERVED_MODEL)
            reply[SERVED_MODEL] = served
        return reply

    @app.post(route_path("shutdown_weight_transfer_engine"))
    async def shutdown_weight_transfer_engine(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        require_owner(state, request, "shutdown_weight_transfer_engine", idempotent=True)
        if session.busy is not None:
            session.check_shutdown()  # a round mid-call: 409 "a weight update is active"
        async with session.operation("shutdown_weight_transfer_engine"):
            if session.phase is Phase.ROUND:
                # Between the round's calls: a trainer that gave its round up (its data link
                # closed) ends it now, not at its lease; a connected one is refused (409).
                await drop_stale_round(state, shutdown=True)
            lease.disarm()
            await fan_out_or_fail(
                state, "shutdown_weight_transfer_engine", "shutdown", timeout=opts.op_timeout_s
            )
            session.shut_down()
        return {"message": "Weight transfer shut down"}


def _round_routes(app: FastAPI, state: ServerState) -> None:
    opts, session, pool, lease = state.options, state.session, state.pool, state.lease

    # The round's three routes return a JSONResponse built here: the same bytes FastAPI
    # would write for the dict, minus its response-model pass (jsonable_encoder and a
    # pydantic validation of every reply), which is a share of each call's fixed cost;
    # and they are plain Starlette routes (``plain_post``): no dependency solving either.
    @plain_post(app, route_path("start_weight_update"))
    async def start_weight_update(request: Request) -> JSONResponse:
        clock = CallClock()
        await read_no_body(request)
        mode = pause_query(request)  # advertised (START_PAUSES): pause first, in this request
        bound = wait_bound_query(request, mode, "pause")  # advertised (PAUSE_BOUNDS)
        _start_checks(state, request, mode)
        await _open_round(state, mode, clock, bound)
        arm_lease(state)
        return JSONResponse({"message": "Weight update started"}, headers=clock.headers())

    @app.post(route_path("start_draft_weight_update"))
    async def start_draft_weight_update(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        raise ApiError(
            400,
            "this server has no speculative-decoding draft model, so there is no draft weight "
            "update to start; use /start_weight_update for the main model",
        )

    @plain_post(app, route_path("update_weights"))
    async def update_weights(request: Request) -> JSONResponse:
        dump_trace("api")  # the last request's marks: none of its own reply's time is spent here
        trace("in")
        try:
            return await _update_weights(request)
        finally:
            trace("out")

    async def _update_weights(request: Request) -> JSONResponse:
        clock = CallClock()
        then = update_finish_query(request)  # advertised (UPDATE_FINISHES); checked first
        starts = update_start_query(request, then)  # advertised (UPDATE_STARTS)
        body = await read_object(
            request,
            allowed=("update_info",) if then is None else ("update_info", "weight_version"),
            required=("update_info",),
        )
        try:
            version = None if then is None else version_field(body, "weight_version", optional=True)
        except ApiError as exc:
            if starts is None:
                raise
            refused = ApiError(
                exc.status,
                f"start_weight_update refused: {exc.message}; nothing was paused or started",
                param=exc.param,
            )
            if starts.pause is not None:
                _say_pause(refused, START_PAUSED_NOTHING, START_PAUSE_NONE, state.gate.mode)
            raise refused from None
        trace("body")
        per: list[dict[str, Any]] | None = None
        if starts is not None:  # the round in one request: the start's steps first
            per = await _start_in_update(state, request, body, starts, clock)
        else:
            require_owner(state, request, "update_weights")
            session.check_update()
        # No await between the start's end and the update's operation: nothing else runs
        # between the two steps of a round in one request.
        async with session.operation("update_weights"):
            lease.disarm()
            if per is None:
                try:
                    per = await _update_payload(state, request, body)
                except NothingToReuse as exc:  # no worker acted: the round stays usable
                    exc.message += "; nothing was done: the round stays open"
                    raise
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
            state.note_update(per)  # an adapter it writes is not unloaded until the round ends
            with clock.part("worker"):
                trace("update>")
                results = await fan_out_or_fail(
                    state,
                    "update_weights",
                    "update",
                    [{"update_info": p} for p in per],
                    timeout=opts.round_timeout_s,
                    abort_on_failure=True,
                )
                trace("update<")
            session.updated(results)
            note_listing(per, session.listings)
            if then is None:
                arm_lease(state)
            else:  # the round's finish, in this request: committed only after the update held
                with clock.part("commit"):
                    await _commit(state, version)
        if then is None:
            return JSONResponse(
                {"message": "Weights updated", "replicas": results}, headers=clock.headers()
            )
        reply = {
            "message": "Weights updated and finished"
            if starts is None
            else "Weight update started, weights updated and finished",
            "replicas": results,
            "weight_version": session.weight_version,
        }
        reply.update(_still_discarded(state))
        return JSONResponse({**reply, **after_commit(state, then)}, headers=clock.headers())

    @plain_post(app, route_path("finish_weight_update"))
    async def finish_weight_update(request: Request) -> JSONResponse:
        clock = CallClock()
        body = await read_object(request, allowed=("weight_version",))
        version = version_field(body, "weight_version", optional=True)
        then = after_commit_query(request)  # checked before anything is done
        require_owner(state, request, "finish_weight_update")
        session.check_finish()
        async with session.operation("finish_weight_update"):
            lease.disarm()
            with clock.part("worker"):
                empty = await _commit(state, version)
        if empty:
            raise ApiError(
                409,
                "no weights were sent in this round (POST /update_weights before "
                f"/finish_weight_update): the round was closed and weight_version stays "
                f"{session.weight_version!r}",
            )
        reply = {"message": "Weight update finished", "weight_version": session.weight_version}
        reply.update(_still_discarded(state))
        done = after_commit(state, then)
        return JSONResponse({**reply, **done}, headers=clock.headers())


def _start_checks(state: ServerState, request: Request, mode: str | None) -> None:
    """What refuses a start before anything is done (the caller's session, the round's
    phase, sleep): the start's and the update's that starts (one definition). A refusal of
    a start that carries a pause (``mode``) says it paused nothing (``start_left_paused``)."""
    try:
        require_owner(state, request, "start_weight_update")
        state.session.check_start()
        _check_awake(state)
    except (ApiError, SessionError) as exc:
        if mode is not None:  # the trainer reads what its pause became (start_left_paused)
            _say_pause(exc, START_PAUSED_NOTHING, START_PAUSE_NONE, state.gate.mode)
        raise


def _check_awake(state: ServerState) -> None:
    """A start is refused while ``/sleep`` holds the weights (its workers would refuse it,
    failing the session): 409 saying how to wake them."""
    if state.sleep.weights_asleep:
        raise SessionError(
            409,
            f"start_weight_update refused: the server is asleep (/sleep level "
            f"{state.sleep.level}) and its weights are not loaded; POST "
            "/wake_up?tags=weights before sending a round",
        )


async def _open_round(
    state: ServerState, mode: str | None, clock: CallClock, wait_s: float | None = None
) -> None:
    """The start once its checks passed: its own pause (``START_PAUSES``; only now, so a
    refusal paused nothing), then every worker's start (a worker written through sends its go
    on the data plane from inside it), and the round is open."""
    session = state.session
    ours: int | None = None
    if mode is not None:
        with clock.part("pause"):
            ours = await _pause_first(state, mode, wait_s)
    async with session.operation("start_weight_update"):
        with clock.part("worker"):
            trace("start>")
            await fan_out_or_fail(
                state,
                "start_weight_update",
                "start",
                {"timeout_s": state.options.op_timeout_s},  # its wait for a generation step
                timeout=state.options.op_timeout_s,
                abort_on_failure=True,
            )
        trace("start<")
        session.started()
        if ours is not None:  # the hold is this round's: a later commit may lift it
            state.gate.round_pause = (ours, session.round_id)


async def _update_payload(
    state: ServerState, request: Request, body: dict[str, Any]
) -> list[dict[str, Any]]:
    """The update info checked, one per replica (``ApiError`` 422 naming the field; 400,
    ``NothingToReuse``, for empty lists with no listing to reuse)."""
    # A round's metadata can list a million names: validate off the event loop. A small
    # body (metadata reuse: empty lists) is checked in microseconds, less than the hop.
    if len(await request.body()) > INLINE_UPDATE_BYTES:  # the body is cached: no second read
        per = await asyncio.to_thread(parse_update_payload, body["update_info"], state.replicas)
    else:
        per = parse_update_payload(body["update_info"], state.replicas)
    check_reuse(per, state.session.listings, per_worker=isinstance(body["update_info"], list))
    return per


async def _start_in_update(
    state: ServerState,
    request: Request,
    body: dict[str, Any],
    starts: StartAsked,
    clock: CallClock,
) -> list[dict[str, Any]]:
    """``UPDATE_STARTS``: the start's checks and the update info's, then the start (its pause,
    its workers' start); returns the update info per replica. Every refusal comes before the
    pause and before any worker starts: the session and the engine stay as they were (the
    trainer wrote nothing: its data path waits for the workers' word from inside the round).
    Every error's message begins with ``start_weight_update`` (what failed)."""
    try:
        _start_checks(state, request, starts.pause)
        try:
            per = await _update_payload(state, request, body)
        except ApiError as exc:
            refused = ApiError(
                exc.status,
                f"start_weight_update refused: the update's {exc.message}; nothing was paused "
                "or started",
                param=exc.param,
            )
            if starts.pause is not None:
                _say_pause(refused, START_PAUSED_NOTHING, START_PAUSE_NONE, state.gate.mode)
            raise refused from None
        await _open_round(state, starts.pause, clock, starts.wait_s)
    except (ApiError, SessionError) as exc:
        if not exc.message.startswith("start_weight_update"):
            verb = "refused" if exc.status < 500 else "failed"
            exc.message = f"start_weight_update {verb}: {exc.message}"
        raise  # the same error: its fields (what the pause became) go with it
    return per


async def _pause_first(state: ServerState, mode: str, wait_s: float | None = None) -> int:
    """A start's own pause (``START_PAUSES``), before any of its workers starts. It may wait
    (``wait``: the running requests drain), and a newer init may replace the session
    meanwhile, or a ``/sleep`` put the weights away, or still holds the session: the start is
    checked again once the pause returned, so a replaced session's start opens no round in
    the new one (whose trainer's own start would then be refused), an asleep server's start
    is refused as at its first check (was: its workers refused it, which failed the session),
    and one met by another operation is refused here, its pause undone (was: refused by its
    own operation's check, its pause left held).
    A start that fails here started no worker: the pause it took is undone (a pause held
    before it stays), unless another pause or a resume came since (the new session's own
    start, an operator). Returns the gate's ``pauses`` count this pause made."""
    session, gate = state.session, state.gate
    serial, held, ours = session.serial, gate.mode, gate.pauses + 1
    try:
        await pause_generation(state, mode, ahead=True, wait_s=wait_s)
        if session.serial != serial:
            raise SessionError(
                409,
                "start_weight_update refused: a newer /init_weight_transfer_engine replaced "
                f"this trainer's session while its start waited for the pause (mode={mode}); "
                "no round was opened. Re-initialize (trainer_init) to take over again",
            )
        session.check_start()
        _check_awake(state)
        if session.busy is not None:
            # An operation that began while the pause drained (a /sleep?mode=wait) holds the
            # session: the start's own operation would be refused next, past this undo.
            raise SessionError(
                409,
                f"start_weight_update refused: another weight operation ({session.busy}) "
                f"began while its start waited for the pause (mode={mode}); no round was "
                "opened; retry when it returns",
            )
    except BaseException as exc:
        if gate.pauses == ours and gate.mode == mode:  # still this start's pause
            if held is None:
                gate.resume()
            else:
                gate.pause(held)
            if isinstance(exc, (ApiError, SessionError)):  # the refusal says what it left
                _say_pause(exc, START_UNDID_PAUSE, START_PAUSE_UNDONE, held)
        raise
    return ours


def _say_pause(exc: ApiError | SessionError, words: str, word: str, held: str | None) -> None:
    """A refused start's word on what its pause became: for a person at the end of its
    message, for the trainer as the error body's field (``START_PAUSE_FIELD``)."""
    exc.message += f"; {words}"
    if held is not None:
        exc.message += f"; {START_KEPT_HELD} (mode={held})"
        word = START_PAUSE_HELD
    exc.fields[START_PAUSE_FIELD] = word


async def _commit(state: ServerState, version: str | None) -> bool:
    """The round's commit on every replica (a finish, or an update that finishes), inside
    the caller's session operation; True when the round had no update (closed, nothing
    committed). A replica that fails: the session fails and the error names
    ``finish_weight_update`` (what failed, whichever request carried it)."""
    opts, session = state.options, state.session
    # The worker itself gives up on the model lock after op_timeout (and then commits
    # nothing); our wait only has to outlast that verdict.
    trace("finish>")
    replies = await fan_out_or_fail(
        state,
        "finish_weight_update",
        "finish",
        {"timeout_s": opts.op_timeout_s},
        timeout=opts.op_timeout_s + _VERDICT_GRACE_S,
        abort_on_failure=True,
    )
    trace("finish<")
    state.sleep.record(replies)
    empty = session.updates_in_round == 0
    if empty:
        session.closed_empty()
    elif state.sleep.missing:
        # /sleep?level=2 discarded tensors that no round has sent since: zeros under a name
        # would say the model is whole (as /update_weight_version refuses to). The round's
        # tensors are committed; its version waits for the round that sends the rest.
        log.warning(
            "round committed, but %d tensor(s) discarded by /sleep?level=2 have not been sent "
            "since: weight_version stays %r (not %r) until a round sends them",
            state.sleep.missing,
            session.weight_version,
            version,
        )
        session.committed(None)
    else:
        session.committed(version)
    return empty


def _still_discarded(state: ServerState) -> dict[str, Any]:
    """A commit's reply while tensors ``/sleep?level=2`` discarded are still unsent: their
    count and why the round's version was not taken (empty otherwise)."""
    missing = state.sleep.missing
    if not missing:
        return {}
    return {
        "discarded_tensors": missing,
        "weight_version_note": (
            f"{missing} tensor(s) discarded by /sleep?level=2 have not been sent since: "
            "weight_version stays unset and generation is refused until a round sends them"
        ),
    }


def _check_routes(app: FastAPI, state: ServerState) -> None:
    session = state.session

    @app.post(route_path("update_weight_version"))
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("new_version",), required=("new_version",))
        version = version_field(body, "new_version", optional=False)
        assert version is not None
        # A version names the weights served: never while a round is changing them, never
        # from a trainer whose session was replaced, never for weights sleep discarded.
        require_owner(state, request, "update_weight_version")
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

    @app.get(route_path("weight_info"))
    async def weight_info() -> dict[str, Any]:
        per = await weights_state(state)
        incomplete = [r for r in per if r.get("round_incomplete")]
        return {
            "weight_version": session.weight_version,
            "session": session.describe(),
            "round_incomplete": bool(incomplete),
            "incomplete_reason": incomplete[0].get("reason") if incomplete else None,
            "replica_weights": per,
            "sleep": state.sleep.describe(),
        }

    @app.post(route_path("weight_checker"))
    async def weight_checker(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("action", "baseline"), required=("action",))
        return await _check_weights(state, body["action"], body.get("baseline"))


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
            await fan_out_or_raise(pool, "reset", opts.op_timeout_s)
        return {"status": "reset"}
    if action == "compare" and baseline is None:
        raise ApiError(400, "action='compare' requires a 'baseline' object", param="baseline")
    per_replica: list[dict[str, str]] = await fan_out_or_raise(pool, "checksum", opts.op_timeout_s)
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
