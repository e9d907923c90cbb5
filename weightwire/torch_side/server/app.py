"""The routes: vLLM's weight-sync API (paths, bodies, replies) plus ``/v1/completions``.

Paths come from ``shared.routes.ROUTES``, shared with the client. Each weight route
validates its body with the ``shared`` dataclasses (422 naming the field), checks the
session rules (409 with the reason), then fans out to every replica and waits for
all of them (bounded); a replica's failure comes back naming the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from weightwire import __version__
from weightwire.shared.info import UpdateInfo
from weightwire.shared.init_infos import INIT_INFO_TYPES
from weightwire.shared.routes import CHECKER_ACTIONS, ROUTES, SESSION_HEADER
from weightwire.shared.timeouts import Timeouts
from weightwire.torch_side.server.auth import ApiKeyMiddleware
from weightwire.torch_side.server.completions import CompletionRequest, CompletionRequestError, parse_completion_request
from weightwire.torch_side.server.lease import RoundLease
from weightwire.torch_side.server.openai import check_model, install_openai_routes
from weightwire.torch_side.server.pause import PauseGate
from weightwire.torch_side.server.replicas import FanOutError, ReplicaError, ReplicaPool
from weightwire.torch_side.server.session import Phase, Session, SessionError
from weightwire.torch_side.server.web import (
    DEFAULT_MAX_BODY_BYTES,
    ApiError,
    BodyLimitMiddleware,
    error_response,
    install_error_handlers,
    read_json,
    read_no_body,
    read_object,
)

SERVER_VERSION = f"0.33.0+weightwire.{__version__}"
"""We implement vLLM 0.33's semantics (metadata reuse, shutdown route), so clients gate on 0.33."""

_MAX_VERSION_CHARS = 1024
_VERDICT_GRACE_S = 10.0
"""How much longer than its own ``timeout_s`` the API waits for a worker's finish verdict:
the worker decides (commit or not) within ``timeout_s``; this only covers a wedged one."""

log = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    backend: str = "weightwire_tcp"
    model_name: str = "model"
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    op_timeout_s: float = 300.0
    """start / finish / shutdown / checksum / reset: local work on each replica."""
    round_timeout_s: float = 3600.0
    """Backstop for one update_weights (the engines time out each chunk on their own)."""
    generate_timeout_s: float = 600.0
    lease_s: float | None = None
    """Round lease (see ``lease``); default: the init info's ``timeout_s`` (the trainer's
    per-broadcast bound), else ``Timeouts.from_env().transfer_s``."""
    model_dir: str | None = None
    """Shown as ``root`` by ``/v1/models``."""
    model_aliases: tuple[str, ...] = ()
    """Other ``model`` names a request may use for the served model (the ``--model`` value, its path)."""


@dataclass
class ServerState:
    pool: ReplicaPool
    options: ServerOptions
    session: Session = field(default_factory=Session)
    gate: PauseGate = field(default_factory=PauseGate)
    lease: RoundLease = field(default_factory=RoundLease)

    @property
    def replicas(self) -> int:
        return len(self.pool)


def _route(name: str) -> str:
    return ROUTES[name].path


def _require_live(pool: ReplicaPool) -> None:
    """A dead worker never rejoins (no respawn): refuse at once instead of letting the
    live ones wait out a rendezvous it will never join."""
    dead = [r for r in pool.health() if not r["alive"]]
    if dead:
        raise ApiError(503, "; ".join(f"replica {r['replica']}: {r['error']}" for r in dead)
                       + "; the reference server does not respawn workers: restart it")


async def _fan_out_or_fail(state: ServerState, what: str, op: str, args: Any = None, *, timeout: float,
                           abort_on_failure: bool = False) -> list[Any]:
    """Run a weight operation on every replica; on failure clear the session and raise
    the HTTP error that says what survived."""
    try:
        return await state.pool.fan_out(op, args, timeout=timeout, abort_on_failure=abort_on_failure)
    except FanOutError as exc:
        raise _fail(state, what, exc) from None


def _fail(state: ServerState, what: str, exc: FanOutError) -> ApiError:
    """Clear the session after a failed weight operation and describe what survived."""
    state.session.failed(f"{what}: {exc}")
    failed = {e.replica for e in exc.errors} | set(exc.aborted)
    ok = [r.index for r in state.pool.replicas if r.index not in failed]
    tail = (f"; the previous weights and weight_version {state.session.weight_version!r} are still served; "
            "POST /init_weight_transfer_engine to start a new session")
    if what == "finish_weight_update" and ok:
        tail = (f"; replicas {ok} committed the new weights but {sorted(failed)} did not: replicas now differ "
                "(compare with /weight_checker); POST /init_weight_transfer_engine and resend")
    return ApiError(exc.status, f"{what} failed: {exc}{tail}")


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="weightwire reference server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.weightwire = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.options.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, api_key=state.options.api_key)  # outermost: before any body is read
    opts, session, pool, gate, lease = state.options, state.session, state.pool, state.gate, state.lease

    @app.exception_handler(SessionError)
    async def _session_error(_: Request, exc: SessionError) -> JSONResponse:
        return error_response(exc.status, exc.message)

    def owner(request: Request, route: str, *, idempotent: bool = False) -> None:
        session.check_owner(request.headers.get(SESSION_HEADER), route, idempotent=idempotent)

    def arm_lease() -> None:
        """(Re)start the round lease after start / each update returned."""
        seconds = opts.lease_s
        if seconds is None:
            raw = getattr(session.init_info, "timeout_s", None)
            seconds = float(raw) if isinstance(raw, (int, float)) else Timeouts.from_env().transfer_s
        round_id = session.round_id

        async def expire() -> None:
            if session.phase is not Phase.ROUND or session.round_id != round_id or session.busy is not None:
                return  # the round moved on (or an operation now decides its fate)
            async with session.operation("round lease"):
                reason = (f"round lease expired: the trainer sent no weight call for {seconds:g} s during its round; "
                          f"the round was aborted and weight_version {session.weight_version!r} is still served")
                session.failed(reason)
                log.warning("%s", reason)
                await pool.abort_all()

        lease.arm(seconds, expire)

    # ------------------------------------------------------------------ session
    @app.post(_route("init_weight_transfer_engine"))
    async def init_weight_transfer_engine(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("init_info",), required=("init_info",))
        raw = body["init_info"]
        if not isinstance(raw, dict):
            raise ApiError(422, f"init_info must be a JSON object, got {type(raw).__name__}", param="init_info")
        try:
            info = INIT_INFO_TYPES[opts.backend].from_dict(raw)
        except ValueError as exc:
            raise ApiError(422, f"init_info: {exc}", param="init_info") from None
        if info.rank_offset + state.replicas > info.world_size:
            raise ApiError(422, (
                f"init_info.world_size {info.world_size} is too small: this server's {state.replicas} worker(s) "
                f"take ranks {info.rank_offset}..{info.rank_offset + state.replicas - 1} (GET /get_world_size)"
            ), param="init_info.world_size")
        # Workers bound the rendezvous and warm-up by their own Timeouts (same environment
        # as ours); this backstop only has to outlast both.
        local = Timeouts.from_env()
        timeout = local.connect_s + local.warmup_s + 30.0
        _require_live(pool)
        async with session.operation("init_weight_transfer_engine"):
            lease.disarm()
            await _fan_out_or_fail(state, "init_weight_transfer_engine", "init", {"init_info": raw}, timeout=timeout, abort_on_failure=True)
            session_id = session.initialized(info)
        return {"message": "Weight transfer initialized", "session_id": session_id}

    @app.post(_route("start_weight_update"))
    async def start_weight_update(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        owner(request, "start_weight_update")
        session.check_start()
        async with session.operation("start_weight_update"):
            await _fan_out_or_fail(state, "start_weight_update", "start", timeout=opts.op_timeout_s, abort_on_failure=True)
            session.started()
            arm_lease()
        return {"message": "Weight update started"}

    @app.post(_route("start_draft_weight_update"))
    async def start_draft_weight_update(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        raise ApiError(400, "this server has no speculative-decoding draft model, so there is no draft weight "
                            "update to start; use /start_weight_update for the main model")

    @app.post(_route("update_weights"))
    async def update_weights(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("update_info",), required=("update_info",))
        owner(request, "update_weights")
        session.check_update()
        async with session.operation("update_weights"):
            lease.disarm()
            try:
                # A round's metadata can list a million names: validate off the event loop.
                per = await asyncio.to_thread(_parse_update_payload, body["update_info"], state.replicas)
            except ApiError as exc:
                # The trainer is already broadcasting: tear the group down so it fails fast.
                await pool.abort_all()
                session.failed(f"update_weights: {exc.message}")
                raise ApiError(exc.status, f"{exc.message}; the round was aborted, POST "
                                           "/init_weight_transfer_engine to start again", param=exc.param) from None
            results = await _fan_out_or_fail(state, "update_weights", "update", [{"update_info": p} for p in per],
                                             timeout=opts.round_timeout_s, abort_on_failure=True)
            session.updated()
            arm_lease()
        return {"message": "Weights updated", "replicas": results}

    @app.post(_route("finish_weight_update"))
    async def finish_weight_update(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("weight_version",))
        version = _version_field(body, "weight_version", optional=True)
        owner(request, "finish_weight_update")
        session.check_finish()
        async with session.operation("finish_weight_update"):
            lease.disarm()
            # The worker itself gives up on the model lock after op_timeout (and then
            # commits nothing); our wait only has to outlast that verdict.
            await _fan_out_or_fail(state, "finish_weight_update", "finish", {"timeout_s": opts.op_timeout_s},
                                   timeout=opts.op_timeout_s + _VERDICT_GRACE_S, abort_on_failure=True)
            empty = session.updates_in_round == 0
            session.closed_empty() if empty else session.committed(version)
        if empty:
            raise ApiError(409, "no weights were sent in this round (POST /update_weights before "
                                f"/finish_weight_update): the round was closed and weight_version stays "
                                f"{session.weight_version!r}")
        return {"message": "Weight update finished", "weight_version": session.weight_version}

    @app.post(_route("shutdown_weight_transfer_engine"))
    async def shutdown_weight_transfer_engine(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        owner(request, "shutdown_weight_transfer_engine", idempotent=True)
        session.check_shutdown()
        async with session.operation("shutdown_weight_transfer_engine"):
            lease.disarm()
            await _fan_out_or_fail(state, "shutdown_weight_transfer_engine", "shutdown", timeout=opts.op_timeout_s)
            session.shut_down()
        return {"message": "Weight transfer shut down"}

    # ------------------------------------------------------------------ version & checks
    @app.post(_route("update_weight_version"))
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("new_version",), required=("new_version",))
        version = _version_field(body, "new_version", optional=False)
        assert version is not None
        session.weight_version = version
        return {"success": True, "new_version": version}

    @app.get(_route("server_info"))
    async def server_info() -> dict[str, Any]:
        # The part of vLLM's dev-mode /server_info a trainer reads: the configured backend.
        return {"server": "weightwire-reference", "vllm_config": {"weight_transfer_config": {"backend": opts.backend}}}

    @app.get(_route("weight_info"))
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": session.weight_version, "session": session.describe()}

    @app.post(_route("weight_checker"))
    async def weight_checker(request: Request) -> dict[str, Any]:
        body = await read_object(request, allowed=("action", "baseline"), required=("action",))
        action, baseline = body["action"], body.get("baseline")
        if action not in CHECKER_ACTIONS:
            raise ApiError(422, f"action must be one of {list(CHECKER_ACTIONS)}, got {action!r:.60}", param="action")
        if baseline is not None and not (
            isinstance(baseline, dict) and all(isinstance(v, str) for v in baseline.values())
        ):
            raise ApiError(422, "baseline must be an object mapping weight names to checksum strings", param="baseline")
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
            return {"checksums": per_replica[0], "replica_checksums": per_replica,
                    "consistent": all(c == per_replica[0] for c in per_replica)}
        assert baseline is not None
        per_mismatch = [sorted(k for k in c.keys() | baseline.keys() if c.get(k) != baseline.get(k)) for c in per_replica]
        mismatches = sorted(set().union(*per_mismatch))
        return {"match": not mismatches, "mismatches": mismatches, "replica_mismatches": per_mismatch}

    @app.get(_route("get_world_size"))
    async def get_world_size(request: Request) -> dict[str, Any]:
        _bool_query(request, "include_dp", default=True)  # accepted; no TP here, so both answers agree
        return {"world_size": state.replicas}

    # ------------------------------------------------------------------ pause
    @app.post(_route("pause"))
    async def pause(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        mode = request.query_params.get("mode", "abort")
        _bool_query(request, "clear_cache", default=True)  # no KV cache outlives a request here
        gate.pause(mode)
        if mode == "abort":
            with contextlib.suppress(FanOutError):  # a dead replica has nothing in flight to cancel
                await pool.fan_out("cancel", timeout=30.0)
        elif mode == "wait":
            await gate.drain(opts.generate_timeout_s)
        return {"status": "paused"}

    @app.post(_route("abort_requests"))
    async def abort_requests(request: Request) -> dict[str, Any]:
        # vLLM's route: abort in-flight requests without pausing; no ids = all of them.
        body = await read_object(request, allowed=("request_ids",))
        if body.get("request_ids"):
            raise ApiError(400, "this server aborts all in-flight requests at once; omit request_ids",
                           param="request_ids")
        aborted = sum(r.inflight_generations for r in pool.replicas)
        with contextlib.suppress(FanOutError):  # a dead replica has nothing in flight to cancel
            await pool.fan_out("cancel", timeout=30.0)
        return {"status": "aborted", "aborted": aborted}

    @app.post(_route("resume"))
    async def resume(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        gate.resume()
        return {"status": "resumed"}

    @app.get(_route("is_paused"))
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": gate.paused}

    @app.get(_route("version"))
    async def version() -> dict[str, Any]:
        return {"version": SERVER_VERSION}

    @app.get(_route("health"))
    async def health() -> JSONResponse:
        replicas = pool.health()
        dead = [r for r in replicas if not r["alive"]]
        if dead:
            return error_response(503, "; ".join(f"replica {r['replica']}: {r['error']}" for r in dead))
        return JSONResponse({"replicas": replicas})

    # ------------------------------------------------------------------ completions
    @app.post(_route("completions"))
    async def completions(request: Request) -> JSONResponse:
        body = await read_json(request)
        info = pool.replicas[0].info
        try:
            # Off the loop: a body near the size limit holds millions of token ids to check.
            req = await asyncio.to_thread(parse_completion_request, body, vocab_size=info["vocab_size"],
                                          max_model_len=info["max_model_len"],
                                          max_prompt_chars=info.get("max_prompt_chars"))
        except CompletionRequestError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        check_model(opts, req)
        result, index = await generate_on_a_replica(state, req)
        result["model"] = req.model or opts.model_name
        return JSONResponse(result, headers={"x-weightwire-replica": str(index)})

    install_openai_routes(app, state, generate_on_a_replica)
    from weightwire.torch_side.server.sleep_routes import install_sleep_routes  # noqa: PLC0415

    install_sleep_routes(app, state)
    return app


async def generate_on_a_replica(state: ServerState, req: CompletionRequest) -> tuple[dict[str, Any], int]:
    """Run one parsed completion request on a replica: pause gate, replica choice, accounting.
    Returns the worker's ``text_completion`` result and the replica's index."""
    opts, pool, gate = state.options, state.pool, state.gate
    await gate.admit(opts.generate_timeout_s)
    try:
        replica = pool.pick()
    except ReplicaError as exc:
        raise ApiError(exc.status, str(exc)) from None
    replica.inflight_generations += 1
    gate.enter()
    try:
        result = await replica.call("generate", {"request": req.to_worker()}, timeout=opts.generate_timeout_s)
    except ReplicaError as exc:
        raise ApiError(exc.status, str(exc)) from None
    finally:
        replica.inflight_generations -= 1
        gate.leave()
    return result, replica.index


async def _fan_out_or_raise(pool: ReplicaPool, op: str, timeout: float) -> Any:
    try:
        return await pool.fan_out(op, timeout=timeout)
    except FanOutError as exc:
        raise ApiError(exc.status, f"{op} failed: {exc}") from None


def _parse_update_payload(payload: Any, replicas: int) -> list[dict[str, Any]]:
    """One validated update-info dict per replica (vLLM's single or per-worker list form)."""
    if isinstance(payload, list):
        if len(payload) != replicas:
            raise ApiError(422, f"update_info lists {len(payload)} entries but this server has {replicas} worker(s); "
                                "send one object, or one per worker", param="update_info")
        items = payload
    elif isinstance(payload, dict):
        items = [payload] * replicas
    else:
        raise ApiError(422, f"update_info must be a JSON object or a list of them, got {type(payload).__name__}",
                       param="update_info")
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
        raise ApiError(422, f"{key} must be a non-empty string of at most {_MAX_VERSION_CHARS} characters, "
                            f"got {value!r:.60}", param=key)
    return value


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _bool_query(request: Request, name: str, *, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ApiError(422, f"query parameter {name} must be true or false, got {raw!r:.40}", param=name)
