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

from weightwire.shared.info import UpdateInfo
from weightwire.torch_side.server import app as app_module
from weightwire.torch_side.server.app import ServerOptions, ServerState, create_app
from weightwire.torch_side.server.session import Phase

pytestmark = pytest.mark.timeout(60)


class RecordingPool:
    def __init__(self) -> None:
        self.replicas: list[Any] = []
        self.calls: list[str] = []

    def __len__(self) -> int:
        return 1

    def health(self) -> list[dict[str, Any]]:
        return [{"replica": 0, "alive": True, "generations_in_flight": 0, "error": None}]

    async def fan_out(self, op: str, args: Any = None, *, timeout: float, abort_on_failure: bool = False) -> list[Any]:
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
    incoming = [{"type": "http.request", "body": body, "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/update_weights", "raw_path": b"/update_weights", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", b"100000")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
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
    payload = {"update_info": {"names": names, "dtype_names": ["float32"] * len(names),
                               "shapes": [[4]] * len(names)}}
    entered, health_done = threading.Event(), threading.Event()
    held: list[bool] = []
    real = UpdateInfo.from_dict.__func__  # type: ignore[attr-defined]

    def slow_from_dict(cls: type[UpdateInfo], data: object) -> UpdateInfo:
        entered.set()
        held.append(health_done.wait(10))  # on the event loop this wait starves /health
        return real(cls, data)

    monkeypatch.setattr(app_module.UpdateInfo, "from_dict", classmethod(slow_from_dict))
    state = make_state()
    app = create_app(state)

    async def scenario() -> tuple[int, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=40) as http:
            update = asyncio.ensure_future(http.post("/update_weights", content=json.dumps(payload).encode(),
                                                     headers={"Content-Type": "application/json"}))
            assert await asyncio.to_thread(entered.wait, 20), "the update never reached its validation"
            health = await http.get("/health")
            health_done.set()
            return health.status_code, (await update).status_code

    statuses = asyncio.run(scenario())
    assert held == [True], "the update's validation blocked the event loop: /health could not answer meanwhile"
    assert statuses == (200, 200)
