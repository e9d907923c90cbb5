"""The rules the weight-sync routes (``weight_routes``) share: the caller's session,
the round lease, the fan-out to every replica and what a failed one leaves served, and
the body fields they parse.

A round holds a lease between calls (``arm_lease``): a trainer that vanishes mid-round
has its round aborted instead of blocking the next init forever.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from weightwire import backends
from weightwire.shared.errors import DELTA_BASE_MISMATCH
from weightwire.shared.limits import LIMITS
from weightwire.shared.routes import REFUSAL_FIELD, ROUTES, SESSION_HEADER
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.update_info import UpdateInfo
from weightwire.tools.server.replica import ReplicaError
from weightwire.tools.server.replicas import FanOutError, ReplicaPool
from weightwire.tools.server.session import Phase, SessionError
from weightwire.tools.server.state import ServerState
from weightwire.tools.server.web import ApiError


def route_path(name: str) -> str:
    return ROUTES[name].path


def require_owner(
    state: ServerState, request: Request, route: str, *, idempotent: bool = False
) -> None:
    state.session.check_owner(request.headers.get(SESSION_HEADER), route, idempotent=idempotent)


def parse_init_info(state: ServerState, raw: Any) -> Any:
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


_LOOK_SLACK_S = 0.5
"""How long after the trainer's transfer bound the workers are asked (``arm_lease``)."""


def arm_lease(state: ServerState) -> None:
    """(Re)start the round lease after start / each update returned. Where the lease is
    longer than the trainer's transfer bound (its init info's ``timeout_s``), the workers are
    asked once at that bound whether the round is stale already (``round_stale``: a
    trainer's bytes waiting unread with no update past its transfer bound, which a trainer
    that died mid-send leaves, its close queued behind them): then the round is aborted as
    the lease would, saying why; else the lease runs on."""
    opts, session, pool = state.options, state.session, state.pool
    raw = getattr(session.init_info, "timeout_s", None)
    link_s = float(raw) if isinstance(raw, (int, float)) else Timeouts.from_env().transfer_s
    seconds = opts.lease_s if opts.lease_s is not None else link_s
    look_s = link_s + _LOOK_SLACK_S  # the workers' own idle clocks started a little earlier
    round_id = session.round_id

    def moved_on() -> bool:
        return (
            session.phase is not Phase.ROUND
            or session.round_id != round_id
            or session.busy is not None
        )  # the round moved on (or an operation now decides its fate)

    async def abort(why: str) -> None:
        async with session.operation("round lease"):
            await pool.abort_all()
            partial = await _holding_part(state)
            # A round applied in place that was aborted left part of it in those replicas'
            # models: they refuse generation, so "still served" would be untrue there.
            kept = (
                f"weight_version {session.weight_version!r} is kept, but replica(s) {partial} "
                "hold part of this round (it was applied in place): they refuse generation "
                "until a whole round commits (/weight_info says)"
                if partial
                else f"weight_version {session.weight_version!r} is still served"
            )
            # logs the round's end; after the awaits: state and busy change together
            session.failed(f"{why}; {kept}")

    async def expire() -> None:
        if moved_on():
            return
        await abort(
            f"round lease expired: the trainer sent no weight call for {seconds:g} s "
            "during its round; the round was aborted"
        )

    async def look() -> None:
        if moved_on():
            return
        try:
            reasons = await pool.fan_out("round_stale", timeout=opts.op_timeout_s)
        except FanOutError:
            reasons = [None]  # cannot tell: the lease decides
        if moved_on():
            return
        if not all(reasons):
            state.lease.arm(seconds - look_s, expire)
            return
        await abort(f"round aborted: {reasons[0]} (every replica)")

    if look_s < seconds:
        state.lease.arm(look_s, look)
    else:
        state.lease.arm(seconds, expire)


async def drop_stale_round(state: ServerState, *, shutdown: bool = False) -> None:
    """An init (or, ``shutdown``, the round's own trainer's shutdown) while a round is open:
    refuse (409) unless every replica's worker finds the round stale (its trainer closed the
    data link, or no call for the worker's lease); then record the round as dropped. The init
    or shutdown that follows tears it down."""
    session, opts = state.session, state.options
    by = "shutdown_weight_transfer_engine" if shutdown else "init_weight_transfer_engine"
    try:
        reasons = await state.pool.fan_out("round_stale", timeout=opts.op_timeout_s)
    except FanOutError as exc:
        raise ApiError(
            exc.status, f"{by}: cannot tell whether the open round is stale: {exc}"
        ) from None
    live = [i for i, r in enumerate(reasons) if not r]
    if live:
        if shutdown:
            session.check_shutdown()  # its trainer is still connected: a shutdown's usual 409
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
    session.dropped(str(reasons[0]), by="its trainer's shutdown" if shutdown else "a newer init")


def require_live(pool: ReplicaPool) -> None:
    """A dead worker never rejoins (no respawn): refuse at once instead of letting the
    live ones wait out a rendezvous it will never join."""
    dead = [r for r in pool.health() if not r["alive"]]
    if dead:
        raise ApiError(
            503,
            "; ".join(f"replica {r['replica']}: {r['error']}" for r in dead)
            + "; the reference server does not respawn workers: restart it",
        )


async def fan_out_or_fail(
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
        partial = await _holding_part(state) if op in _WRITES else []
        raise _fail(state, what, exc, partial) from None


_WRITES = ("update", "finish")
"""The operations whose failure may leave a round applied in place half written."""

WEIGHTS_STATE_S = 5.0
"""A replica answers whether its model holds part of a round from its reader thread, at once."""


async def weights_state(state: ServerState) -> list[dict[str, Any]]:
    """Each replica's ``weights`` answer (answered by its reader thread at once, even mid-round);
    a replica that cannot answer is reported, never a reason to fail the caller."""

    async def one(replica: Any) -> dict[str, Any]:
        try:
            answer = await replica.call("weights", timeout=WEIGHTS_STATE_S)
        except ReplicaError as exc:
            return {"round_incomplete": None, "reason": str(exc)}
        if not isinstance(answer, dict):  # a receiver that keeps no such state (a bench shim)
            return {"round_incomplete": None, "reason": f"no weights state: {answer!r}"}
        return answer

    return list(await asyncio.gather(*(one(r) for r in state.pool.replicas)))


async def _holding_part(state: ServerState) -> list[int]:
    """The replicas whose model now holds part of a round (one applied in place that
    failed): they refuse generation until a whole round commits. A replica that cannot
    answer (dead) is not listed: the failure names it already."""
    per = await weights_state(state)
    return [
        r.index
        for r, answer in zip(state.pool.replicas, per, strict=True)
        if answer.get("round_incomplete") is True
    ]


def _fail(
    state: ServerState, what: str, exc: FanOutError, partial: list[int] | None = None
) -> ApiError:
    """Clear the session after a failed weight operation and describe what survived
    (``partial``: the replicas whose model holds part of the round, ``_holding_part``)."""
    state.session.failed(f"{what}: {exc}")
    failed = {e.replica for e in exc.errors} | set(exc.aborted)
    ok = [r.index for r in state.pool.replicas if r.index not in failed]
    tail = (
        f"; the previous weights and weight_version {state.session.weight_version!r} are still "
        "served; start a new session (a weightwire trainer: engine.shutdown(), then "
        "trainer_init() again)"
    )
    if partial:
        # Was: "the previous weights ... are still served" over a model the round had
        # partly written in place, which refuses generation.
        tail = (
            f"; weight_version {state.session.weight_version!r} is kept, but replica(s) "
            f"{partial} hold part of this round (it was applied in place): they refuse "
            "generation until a whole round commits (/weight_info says); start a new session "
            "(a weightwire trainer: engine.shutdown(), then trainer_init() again) and send a "
            "whole round"
        )
    if what == "start_weight_update":
        # A worker written through sends its go from inside its start: on one server the
        # trainer may have written at it, so that replica refuses generation until a whole
        # round commits (/weight_info's round_incomplete says which).
        tail = (
            f"; weight_version {state.session.weight_version!r} is kept (a replica whose round "
            "was written in place from its start refuses generation until a whole round "
            "commits: /weight_info says); start a new session (a weightwire trainer: "
            "engine.shutdown(), then trainer_init() again)"
        )
    if what == "finish_weight_update" and ok:
        tail = (
            f"; replicas {ok} committed the new weights but {sorted(failed)} did not: replicas "
            "now differ (compare with /weight_checker); start a new session (a weightwire "
            "trainer: engine.shutdown(), then trainer_init() again) and resend"
        )
    error = ApiError(exc.status, f"{what} failed: {exc}{tail}")
    if any(e.kind == "delta_base" for e in exc.errors):  # the trainer resends the round dense
        error.fields[REFUSAL_FIELD] = DELTA_BASE_MISMATCH
    return error


async def fan_out_or_raise(pool: ReplicaPool, op: str, timeout: float) -> Any:
    try:
        return await pool.fan_out(op, timeout=timeout)
    except FanOutError as exc:
        raise ApiError(exc.status, f"{op} failed: {exc}") from None


def parse_update_payload(payload: Any, replicas: int) -> list[dict[str, Any]]:
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


class NothingToReuse(ApiError):
    """An update of empty lists (vLLM 0.33's "reuse the previous round's tensors") whose
    broadcaster has no listing to reuse in this session: refused before any worker acts,
    the open round kept (``check_reuse``)."""


def check_reuse(
    items: list[dict[str, Any]], listings: dict[int, bool], *, per_worker: bool
) -> None:
    """``NothingToReuse`` (400) for an update info that lists no tensors where its broadcaster
    listed none since the init, or last listed a delta round's patch tensors: the workers
    would refuse it after the round opened, which fails the session."""
    for i, item in enumerate(items if per_worker else items[:1]):
        if item.get("names"):
            continue
        src = item.get("src", 0)
        where = f"update_info[{i}]" if per_worker else "update_info"
        whose = f" from src {src}" if src else ""
        if src not in listings:
            raise NothingToReuse(
                400,
                f"{where} lists no tensors (empty names, dtype_names and shapes: reuse the "
                f"previous round's tensor list) but this session has no previous round's "
                f"tensor list to reuse{whose}: no update since /init_weight_transfer_engine "
                "listed any; send the round's names, dtype_names and shapes",
                param=where,
            )
        if listings[src]:
            raise NothingToReuse(
                400,
                f"{where} lists no tensors (reuse the previous round's tensor list), but the "
                f"previous list{whose} was a delta round's patch tensors, which a round "
                "describes in full; send the round's names, dtype_names and shapes",
                param=where,
            )


def note_listing(items: list[dict[str, Any]], listings: dict[int, bool]) -> None:
    """An update the workers took: the list its broadcaster's next empty update reuses."""
    for item in items[:1]:  # every replica's update names the same tensors
        if item.get("names"):
            listings[item.get("src", 0)] = bool(item.get("patches"))


def version_field(body: dict[str, Any], key: str, *, optional: bool) -> str | None:
    value = body.get(key)
    if value is None and optional:
        return None
    most = LIMITS.max_weight_version_chars
    if not isinstance(value, str) or not value or len(value) > most:
        raise ApiError(
            422,
            f"{key} must be a non-empty string of at most {most} characters, got {value!r:.60}",
            param=key,
        )
    return value
