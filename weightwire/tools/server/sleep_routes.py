"""``/sleep``, ``/wake_up``, ``/is_sleeping``: vLLM's sleep-mode routes on the reference server.

Same query parameters and replies as vLLM's dev-mode router: ``/sleep?level=0|1|2&mode=
abort|wait|keep`` -> ``{"status": "sleeping", "level": N}`` (and, as a pause that waits,
``wait_s`` with ``mode=wait``: ``routes.PAUSE_BOUNDS``); ``/wake_up?tags=weights&
tags=kv_cache`` (no tags: everything) -> ``{"status": "awake"|"sleeping", "tags": [...]}``.
Generation is held from ``/sleep`` until the workers are fully awake again (a hold of
its own: ``/wake_up`` never lifts a trainer's ``/pause``); what each level frees is in
``sleep.ModelSleeper``.

Consistency: ``/is_sleeping`` and ``/weight_info`` say what the workers did. A sleep is
refused while a round is open or another weight operation runs; a sleep that fails
(a worker's timeout, a dead replica) is undone before the error is returned (a
``cancel_sleep`` so a waiting sleep never runs later, then a wake), so a failed
``/sleep`` never takes effect afterwards. After level 2 the weights are gone: the
version is cleared and generation is refused until a round has sent every tensor again.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from fastapi import FastAPI, Request

from weightwire.shared.routes import PAUSE_MODES, SLEEP_LEVELS, WAKE_TAGS
from weightwire.tools.server.after_commit import wait_bound_query
from weightwire.tools.server.replicas import FanOutError
from weightwire.tools.server.state import ServerState
from weightwire.tools.server.web import ApiError, query_once, read_no_body

_VERDICT_GRACE_S = 10.0
"""How much longer than its own ``timeout_s`` the API waits for a worker's sleep verdict."""
_CANCEL_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)


def install_sleep_routes(app: FastAPI, state: ServerState) -> None:
    pool, gate, opts, session, slept = (
        state.pool,
        state.gate,
        state.options,
        state.session,
        state.sleep,
    )

    async def fan_out(op: str, args: dict[str, Any]) -> list[Any]:
        try:
            return await pool.fan_out(op, args, timeout=opts.op_timeout_s + _VERDICT_GRACE_S)
        except FanOutError as exc:
            raise ApiError(exc.status, f"{op} failed: {exc}") from None

    async def put_to_sleep(level: int, mode: str, wait_s: float | None) -> list[Any]:
        if mode == "abort":
            with contextlib.suppress(FanOutError):
                await pool.fan_out("cancel", timeout=_CANCEL_TIMEOUT_S)
        elif mode == "wait":
            # Bounded by the client's wait too (PAUSE_BOUNDS): past it the client has given
            # up, so the sleep fails (504) and is undone rather than landing later.
            bound = opts.generate_timeout_s
            await gate.drain(bound if wait_s is None else min(bound, wait_s))
        if not level:
            return []
        try:
            return await pool.fan_out(
                "sleep",
                {"level": level, "timeout_s": opts.op_timeout_s},
                timeout=opts.op_timeout_s + _VERDICT_GRACE_S,
            )
        except FanOutError as exc:
            raise ApiError(exc.status, str(exc)) from None

    async def undo(level: int, held: str | None) -> str:
        """After a failed sleep: no sleep may still run, every worker awake, the hold as before."""
        with contextlib.suppress(FanOutError):
            await pool.fan_out("cancel_sleep", timeout=_CANCEL_TIMEOUT_S)
        note = "the server did not sleep"
        if level:
            try:
                slept.record(
                    await pool.fan_out(
                        "wake", {"tags": None}, timeout=opts.op_timeout_s + _VERDICT_GRACE_S
                    )
                )
            except FanOutError as exc:
                note = f"waking the replicas again failed too ({exc})"
        if slept.missing:
            session.weight_version = None
            note += (
                f"; replica(s) {sorted(i for i, n in slept.discarded.items() if n)} had "
                "discarded their weights (level 2) before the failure: send a full round "
                "before generating"
            )
        gate.hold_for_sleep(held)
        return note

    @app.post("/sleep")
    async def sleep(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        raw, mode = query_once(request, "level"), query_once(request, "mode")
        raw, mode = ("1" if raw is None else raw), ("abort" if mode is None else mode)
        if raw not in {str(x) for x in SLEEP_LEVELS}:
            raise ApiError(
                422, f"level must be one of {list(SLEEP_LEVELS)}, got {raw[:20]!r}", param="level"
            )
        if mode not in PAUSE_MODES:
            raise ApiError(
                422, f"mode must be one of {list(PAUSE_MODES)}, got {mode[:20]!r}", param="mode"
            )
        level = int(raw)
        bound = wait_bound_query(request, mode, "mode")  # advertised (PAUSE_BOUNDS)
        session.check_no_round("sleep")
        if slept.level is not None and slept.level >= level:
            return {"status": "sleeping", "level": slept.level}  # already that deep: nothing to do
        async with session.operation("sleep"):
            held = gate.sleep_mode
            gate.hold_for_sleep(mode)
            try:
                replies = await put_to_sleep(level, mode, bound)
            except ApiError as exc:
                note = await undo(level, held)
                log.warning("/sleep?level=%d failed: %s; %s", level, exc.message, note)
                raise ApiError(exc.status, f"sleep failed: {exc.message}; {note}") from None
            slept.record(replies)
            slept.level = level
            slept.weights_asleep = slept.weights_asleep or level >= 1
            if slept.missing:
                session.weight_version = None  # the weights it named are gone
        log.info("asleep at level %d (mode=%s)", level, mode)
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        tags = request.query_params.getlist("tags") or None
        bad = [t for t in tags or () if t not in WAKE_TAGS]
        if bad:
            raise ApiError(
                422,
                f"unknown tags {[t[:20] for t in bad[:5]]}; known: {list(WAKE_TAGS)}",
                param="tags",
            )
        replies = await fan_out("wake", {"tags": tags})
        slept.record(replies)
        awake = all(isinstance(r, dict) and r.get("awake") for r in replies)
        if awake and slept.level is not None:
            slept.level, slept.weights_asleep = None, False
            gate.hold_for_sleep(None)  # a trainer's /pause stays
            log.info(
                "awake%s",
                f"; {slept.missing} discarded tensor(s) still to be sent" if slept.missing else "",
            )
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": slept.level is not None}
