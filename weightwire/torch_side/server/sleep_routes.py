"""``/sleep``, ``/wake_up``, ``/is_sleeping``: vLLM's sleep-mode routes on the reference server.

Same query parameters and replies as vLLM's dev-mode router: ``/sleep?level=0|1|2&mode=
abort|wait|keep`` -> ``{"status": "sleeping", "level": N}``; ``/wake_up?tags=weights&
tags=kv_cache`` (no tags: everything) -> ``{"status": "awake"|"sleeping", "tags": [...]}``.
Generation is paused from ``/sleep`` until the workers are fully awake again; what each
level frees is in ``sleep.ModelSleeper``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import FastAPI, Request

from weightwire.shared.routes import PAUSE_MODES, SLEEP_LEVELS, WAKE_TAGS
from weightwire.torch_side.server.replicas import FanOutError
from weightwire.torch_side.server.web import ApiError, read_no_body


def install_sleep_routes(app: FastAPI, state: Any) -> None:
    pool, gate, opts = state.pool, state.gate, state.options
    asleep: dict[str, int | None] = {"level": None}

    async def fan_out(op: str, args: dict[str, Any]) -> list[Any]:
        try:
            return await pool.fan_out(op, args, timeout=opts.op_timeout_s)
        except FanOutError as exc:
            raise ApiError(exc.status, f"{op} failed: {exc}") from None

    @app.post("/sleep")
    async def sleep(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        raw, mode = request.query_params.get("level", "1"), request.query_params.get("mode", "abort")
        if raw not in {str(x) for x in SLEEP_LEVELS}:
            raise ApiError(422, f"level must be one of {list(SLEEP_LEVELS)}, got {raw[:20]!r}", param="level")
        if mode not in PAUSE_MODES:
            raise ApiError(422, f"mode must be one of {list(PAUSE_MODES)}, got {mode[:20]!r}", param="mode")
        level = int(raw)
        gate.pause(mode)
        if mode == "abort":
            with contextlib.suppress(FanOutError):
                await pool.fan_out("cancel", timeout=30.0)
        elif mode == "wait":
            await gate.drain(opts.generate_timeout_s)
        if level:
            await fan_out("sleep", {"level": level})
        asleep["level"] = level
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        await read_no_body(request)
        tags = request.query_params.getlist("tags") or None
        bad = [t for t in tags or () if t not in WAKE_TAGS]
        if bad:
            raise ApiError(422, f"unknown tags {[t[:20] for t in bad[:5]]}; known: {list(WAKE_TAGS)}", param="tags")
        replies = await fan_out("wake", {"tags": tags})
        awake = all(isinstance(r, dict) and r.get("awake") for r in replies)
        if awake and asleep["level"] is not None:
            asleep["level"] = None
            gate.resume()
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": asleep["level"] is not None}
