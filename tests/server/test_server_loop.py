"""The API process's event loop: clients that leave mid-body, and bodies big enough to
stall it. The real app (``create_app``), driven in-process over ASGI; the replica pool is
a recorder (these cases never reach a worker's model)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import httpx
import pytest

from weightwire.shared.update_info import UpdateInfo
from weightwire.tools.server.app import ServerOptions, ServerState, create_app
from weightwire.tools.server.session import Phase

pytestmark = pytest.mark.timeout(60)


class RecordingPool:
    def __init__(self) -> None:
        self.replicas: list[Any] = []
        self.calls: list[str] = []

    def __len__(self) -> int:
        return 1

    def health(self) -> list[dict[str, Any]]:
        return [{"replica": 0, "alive": True, "generations_in_flight": 0, "error": None}]

    async def fan_out(
        self, op: str, args: Any = None, *, timeout: float, abort_on_failure: bool = False
    ) -> list[Any]:
        self.calls.append(op)
        return [{}]

    async def abort_all(self, timeout: float = 30.0) -> None:
        self.calls.append("abort")


def make_state() -> ServerState:
    state = ServerState(pool=RecordingPool(), options=ServerOptions())  # type: ignore[arg-type]
    state.session.initialized(object())
    state.session.started()
    assert state.session.phase is Phase.ROUND
    return state


def test_client_that_disconnects_mid_body_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    """A trainer that aborts while posting its update: the app must neither raise (uvicorn
    would log "Exception in ASGI application") nor log an ERROR traceback of its own."""
    state = make_state()
    app = create_app(state)
    body = b'{"update_info": {"names": ["model.embed'
    incoming = [
        {"type": "http.request", "body": body, "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/update_weights",
        "raw_path": b"/update_weights",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100000")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))  # raises on main: the exception escaped the app
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert state.pool.calls == []  # nothing reached a worker  # type: ignore[attr-defined]


def test_a_huge_update_body_does_not_stall_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a big update's metadata is being validated, ``/health`` still answers: the
    validation is held (an event) until ``/health`` has returned, which can only happen if
    the validation runs off the event loop."""
    names = [f"model.layers.{i}.weight" for i in range(20_000)]
    payload = {
        "update_info": {
            "names": names,
            "dtype_names": ["float32"] * len(names),
            "shapes": [[4]] * len(names),
        }
    }
    entered, health_done = threading.Event(), threading.Event()
    held: list[bool] = []
    real = UpdateInfo.from_dict.__func__  # type: ignore[attr-defined]

    def slow_from_dict(cls: type[UpdateInfo], data: object) -> UpdateInfo:
        entered.set()
        held.append(health_done.wait(10))  # on the event loop this wait starves /health
        return real(cls, data)

    monkeypatch.setattr(UpdateInfo, "from_dict", classmethod(slow_from_dict))
    state = make_state()
    app = create_app(state)

    async def scenario() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://test", timeout=40
        ) as http:
            update = asyncio.ensure_future(
                http.post(
                    "/update_weights",
                    content=json.dumps(payload).encode(),
                    headers={"Content-Type": "application/json"},
                )
            )
            assert await asyncio.to_thread(entered.wait, 20), (
                "the update never reached its validation"
            )
            health = await http.get("/health")
            health_done.set()
            return health.status_code, (await update).status_code

    statuses = asyncio.run(scenario())
    assert held == [True], (
        "the update's validation blocked the event loop: /health could not answer meanwhile"
    )
    assert statuses == (200, 200)


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30
    )


def _leased(pool: RecordingPool) -> ServerState:
    """A session at version ``v1`` whose rounds hold a 0.2 s lease."""
    state = ServerState(pool=pool, options=ServerOptions(lease_s=0.2))  # type: ignore[arg-type]
    state.session.initialized(object())
    state.session.weight_version = "v1"
    return state


def test_round_lease_aborts_an_idle_round_and_weight_calls_rearm_it() -> None:
    state = _leased(RecordingPool())
    app = create_app(state)

    async def scenario() -> None:
        async with _client(app) as http:
            assert (await http.post("/start_weight_update")).status_code == 200
            assert state.lease.armed
            meta = {"update_info": {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}}
            assert (await http.post("/update_weights", json=meta)).status_code == 200
            assert (
                state.lease.armed and state.session.phase is Phase.ROUND
            )  # re-armed, round still open
            while state.session.phase is Phase.ROUND:  # the trainer is gone: nobody posts finish
                await asyncio.sleep(0.02)

    asyncio.run(scenario())
    assert state.session.phase is Phase.NO_ENGINE and state.session.weight_version == "v1"
    assert "round lease expired" in (state.session.last_error or "")
    assert state.pool.calls == ["start", "update", "abort"]  # type: ignore[attr-defined]


class _PartlyWritten:
    """A replica whose model holds part of the aborted round (it was applied in place)."""

    index = 0

    async def call(self, op: str, args: Any = None, *, timeout: float) -> Any:
        assert op == "weights"
        return {"round_incomplete": True}


def test_a_lease_that_aborts_a_round_applied_in_place_says_which_replicas_hold_part() -> None:
    """The lease aborts a round whose replica holds part of it: the session's error names that
    replica and that it refuses generation, never "still served" (the round was written in
    place: the previous weights are not whole there)."""
    pool = RecordingPool()
    pool.replicas = [_PartlyWritten()]
    state = _leased(pool)
    app = create_app(state)

    async def scenario() -> None:
        async with _client(app) as http:
            assert (await http.post("/start_weight_update")).status_code == 200
            while state.session.phase is Phase.ROUND:  # the trainer is gone
                await asyncio.sleep(0.02)

    asyncio.run(scenario())
    error = state.session.last_error or ""
    assert "round lease expired" in error and "still served" not in error, error
    assert "replica(s) [0] hold part of this round" in error, error
    assert "weight_version 'v1' is kept" in error, error


def test_a_stale_session_is_refused_before_any_worker_is_touched() -> None:
    from weightwire.shared.info import encode_secret
    from weightwire.shared.routes import SESSION_HEADER

    state = ServerState(pool=RecordingPool(), options=ServerOptions())  # type: ignore[arg-type]
    app = create_app(state)
    init = {
        "init_info": {
            "host": "127.0.0.1",
            "port": 5000,
            "secret_b64": encode_secret(b"s" * 128),
            "rank_offset": 1,
            "world_size": 2,
        }
    }

    async def scenario() -> None:
        async with _client(app) as http:
            first = (await http.post("/init_weight_transfer_engine", json=init)).json()[
                "session_id"
            ]
            second = (await http.post("/init_weight_transfer_engine", json=init)).json()[
                "session_id"
            ]
            assert first != second
            state.pool.calls.clear()  # type: ignore[attr-defined]
            for route in ("/start_weight_update", "/shutdown_weight_transfer_engine"):
                resp = await http.post(route, headers={SESSION_HEADER: first})
                assert resp.status_code == 409 and "replaced by a newer" in resp.text, resp.text
                assert second not in resp.text
            assert state.pool.calls == []  # type: ignore[attr-defined]
            assert (
                await http.post("/start_weight_update", headers={SESSION_HEADER: second})
            ).status_code == 200

    asyncio.run(scenario())
