"""The round guard (``weightwire.vllm_guard.RoundGuard``) in a FastAPI app built as vLLM builds
its API server: routes, ``app.state.engine_client`` / ``app.state.args``, and the middleware
added with ``app.add_middleware`` (what ``--middleware`` does). The engine client stands in
for vLLM's; its workers answer with the real ``worker_round_state`` over real weightwire
engines (``WeightState`` records a broken round as a failed round in place does)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any
from unittest.mock import ANY

import pytest
import torch
import uvicorn
from fastapi import FastAPI, WebSocket
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from weightwire import vllm_guard
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.shared.errors import WeightSyncError
from weightwire.torch_side.worker.engines import WeightwireTCPEngine
from weightwire.torch_side.worker.hf_host import HFModelHost
from weightwire.torch_side.worker.weight_state import WeightState
from weightwire.trainer.caps import ClientCaps
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.gating import RoundPause, after_failed_round, guard_installed, round_pause
from weightwire.vllm_guard.worker import worker_round_state

BROKEN = "the model holds an incomplete weight round"


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(4, 4)


class EngineClient:
    """vLLM's ``EngineClient`` surface the guard uses: ``collective_rpc`` runs the method on
    each worker (as vLLM's executor does, by name), plus pause state."""

    def __init__(self, workers: list[Any], *, delay_s: float = 0.0) -> None:
        self.workers = workers
        self.delay_s = delay_s
        self.paused = False
        self.resume_error: Exception | None = None

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = ()
    ) -> list[Any]:
        await asyncio.sleep(self.delay_s)
        return [getattr(w, method)(*args) for w in self.workers]

    async def is_paused(self) -> bool:
        return self.paused

    async def resume_generation(self) -> None:
        if self.resume_error is not None:
            raise self.resume_error
        self.paused = False


class LaggingEngineClient(EngineClient):
    """vLLM 0.32's multiproc executor after a call failed on several workers
    (vllm-project/vllm#49972): every worker after the first answers a call late, its reply
    to the call before (``earlier``: its reply to a call before the first asked here)."""

    def __init__(self, workers: list[Any], earlier: list[Any]) -> None:
        super().__init__(workers)
        self.late = list(earlier)

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = ()
    ) -> list[Any]:
        fresh = await super().collective_rpc(method, timeout, args)
        answers, self.late = [fresh[0], *self.late], fresh[1:]
        return answers


class Worker:
    """A vLLM worker as the plugin leaves it: ``weight_transfer_engine`` and the method
    ``install_worker_method`` puts on vLLM's ``WorkerBase``."""

    weightwire_round_state = worker_round_state

    def __init__(self, weights: WeightState) -> None:
        self.weight_transfer_engine = WeightwireTCPEngine.standalone(
            model=HFModelHost(Tiny()), weights=weights
        )


def build_app(
    workers: list[Any],
    *,
    api_server_count: int = 1,
    api_key: list[str] | None = None,
    delay_s: float = 0.0,
) -> FastAPI:
    app = FastAPI()
    app.state.engine_client = EngineClient(workers, delay_s=delay_s)
    app.state.args = SimpleNamespace(api_server_count=api_server_count, api_key=api_key)

    @app.post("/v1/completions")
    async def completions() -> dict[str, Any]:
        return {"choices": [{"text": "served"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> dict[str, Any]:
        return {"choices": [{"message": "served"}]}

    @app.post("/tokenize")
    async def tokenize() -> dict[str, Any]:
        return {"tokens": [1]}

    @app.post("/pause")
    async def pause() -> dict[str, Any]:
        app.state.engine_client.paused = True
        return {}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": []}

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        await ws.accept()
        await ws.send_text("served")
        await ws.close()

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT"])
    async def any_model_route(path: str) -> dict[str, Any]:
        return {"ran_the_model": path}  # what a route this app does not know stands for

    app.add_middleware(vllm_guard.RoundGuard)
    return app


@pytest.fixture
def weights() -> WeightState:
    return WeightState()


@pytest.fixture
def http(weights: WeightState) -> Iterator[TestClient]:
    with TestClient(build_app([Worker(weights), Worker(WeightState())])) as client:
        yield client


def _complete(http: TestClient) -> Any:
    return http.post("/v1/completions", json={"prompt": "hi"})


def test_status_reports_an_installed_guard_that_covers_the_server(http: TestClient) -> None:
    state = http.get("/weightwire/round_guard").json()
    assert state["guard"] == "weightwire" and state["covers"] is True and state["held"] is False
    assert _complete(http).json() == {"choices": [{"text": "served"}]}


def test_held_guard_refuses_what_runs_the_model_with_the_reason(http: TestClient) -> None:
    assert (
        http.post("/weightwire/round_guard/hold", json={"round": "v7", "session": "s1"}).status_code
        == 200
    )
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/inference/v1/generate",
    ):
        reply = http.post(path, json={})
        assert reply.status_code == 503, (path, reply.text)
        assert reply.headers["retry-after"] == "10"
        error = reply.json()["error"]
        assert error["reason"] == "weight_round_incomplete" and error["round"]["round"] == "v7"
        assert error["message"].startswith(
            "the served weights are incomplete: weight round 'v7' (session s1) "
            "is applied in place and has not committed (since 20"
        )
        assert (
            "POST /weightwire/round_guard/release once the workers' weights are whole"
            in error["message"]
        )
    # Control, tokenization and every GET pass.
    assert http.post("/tokenize", json={}).json() == {"tokens": [1]}
    assert http.get("/v1/models").status_code == 200
    assert http.post("/pause").status_code == 200
    with pytest.raises(WebSocketDisconnect) as closed, http.websocket_connect("/v1/realtime") as ws:
        ws.receive_text()
    assert closed.value.code == 1013 and "weights are incomplete" in closed.value.reason


def test_release_is_refused_while_a_worker_holds_a_broken_round(
    http: TestClient, weights: WeightState
) -> None:
    http.post("/weightwire/round_guard/hold", json={"round": "v7"})
    weights.broke(
        "s1", "streaming round ended without its commit: trainer gone", frozenset({"w.weight"})
    )
    reply = http.post("/weightwire/round_guard/release")
    assert reply.status_code == 409, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith(
        f"not released: worker 0: {BROKEN} (session s1, streaming round ended"
    )
    assert message.endswith("the guard keeps refusing until a complete round commits")
    assert http.get("/weightwire/round_guard").json()["held"] is True
    assert _complete(http).status_code == 503
    # A complete round rewrote the tensor in doubt: the release now lifts the guard.
    weights.committed(frozenset({"w.weight", "w.bias"}))
    http.post("/pause")
    reply = http.post("/weightwire/round_guard/release")
    assert reply.status_code == 200 and reply.json()["released"] and reply.json()["resumed"], (
        reply.text
    )
    assert http.app.state.engine_client.paused is False  # type: ignore[attr-defined]
    assert _complete(http).status_code == 200


def test_release_without_resume_keeps_a_pause(http: TestClient) -> None:
    http.post("/weightwire/round_guard/hold", json={"round": "v1"})
    http.post("/pause")
    reply = http.post("/weightwire/round_guard/release", params={"resume": "false"})
    assert reply.json()["released"] is True and reply.json()["resumed"] is False
    assert http.app.state.engine_client.paused is True  # type: ignore[attr-defined]


def test_a_failed_resume_is_answered_not_raised(http: TestClient) -> None:
    http.post("/weightwire/round_guard/hold", json={"round": "v1"})
    http.post("/pause")
    engine = http.app.state.engine_client  # type: ignore[attr-defined]
    engine.resume_error = RuntimeError("engine core is dead")
    reply = http.post("/weightwire/round_guard/release")
    assert reply.status_code == 502 and reply.json()["error"]["message"] == (
        "the guard was released, but resuming generation failed "
        "(RuntimeError: engine core is dead): POST /resume"
    )
    assert http.get("/weightwire/round_guard").json()["held"] is False


def test_release_fails_closed_when_workers_cannot_tell_or_do_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock = SimpleNamespace(weight_transfer_engine=object(), weightwire_round_state=None)
    stock.weightwire_round_state = lambda *args: worker_round_state(stock, *args)
    with TestClient(build_app([stock])) as http:
        http.post("/weightwire/round_guard/hold", json={"round": "v1"})
        reply = http.post("/weightwire/round_guard/release")
        assert reply.status_code == 409
        assert (
            "weight-transfer engine object is not weightwire's" in reply.json()["error"]["message"]
        )
    monkeypatch.setattr(vllm_guard, "WORKER_TIMEOUT_S", 0.05)
    with TestClient(build_app([Worker(WeightState())], delay_s=5.0)) as http:
        http.post("/weightwire/round_guard/hold", json={"round": "v1"})
        reply = http.post("/weightwire/round_guard/release")
        assert reply.status_code == 409
        assert "the workers did not answer within 0 s (a round may be in progress)" in reply.text


def test_release_is_refused_when_a_worker_answers_an_earlier_call(weights: WeightState) -> None:
    """Worker 1 holds a broken round, but vLLM's executor hands the guard its reply to an
    earlier release's question (whole then): the guard must not take it for this release's."""
    workers = [Worker(WeightState()), Worker(weights)]
    earlier = worker_round_state(workers[1], "an earlier release")
    assert earlier["whole"] is True
    app = build_app(workers)
    app.state.engine_client = LaggingEngineClient(workers, [earlier])
    with TestClient(app) as http:
        http.post("/weightwire/round_guard/hold", json={"round": "v3"})
        weights.broke("s1", "streaming round ended without its commit", frozenset({"w.weight"}))
        reply = http.post("/weightwire/round_guard/release")
        assert reply.status_code == 409, reply.text
        message = reply.json()["error"]["message"]
        assert message.startswith("not released: worker 1: its answer is to an earlier call")
        assert "vllm-project/vllm#49972); restart the server" in message
        assert http.get("/weightwire/round_guard").json()["held"] is True
        # Still late: the next release reads worker 1's reply to this one (not whole now).
        reply = http.post("/weightwire/round_guard/release")
        assert (
            reply.status_code == 409
            and "worker 1: its answer is to an earlier call" in (reply.json()["error"]["message"])
        )


def test_several_api_server_processes_are_not_covered() -> None:
    with TestClient(build_app([Worker(WeightState())], api_server_count=4)) as http:
        assert http.get("/weightwire/round_guard").json()["covers"] is False
        reply = http.post("/weightwire/round_guard/hold", json={"round": "v1"})
        assert (
            reply.status_code == 409
            and "runs 4 API-server processes" in reply.json()["error"]["message"]
        )
        assert _complete(http).status_code == 200


def test_bad_hold_and_unknown_routes_are_refused_clearly(http: TestClient) -> None:
    reply = http.post("/weightwire/round_guard/hold", json={"round": ""})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == (
        "bad hold request: 'round' must be a non-empty string of at most 200 characters"
    )
    assert http.post("/weightwire/round_guard/hold", content=b"{not json").status_code == 400
    assert http.post("/weightwire/round_guard/hold", content=b"x" * (70 << 10)).status_code == 400
    assert http.get("/weightwire/round_guard/hold").status_code == 405
    assert http.get("/weightwire/round_guard/nope").status_code == 404
    assert http.get("/weightwire/round_guard").json()["held"] is False


def test_guard_routes_need_the_api_key() -> None:
    with TestClient(build_app([Worker(WeightState())], api_key=["k1"])) as http:
        assert http.post("/weightwire/round_guard/hold", json={"round": "v1"}).status_code == 401
        ok = http.post(
            "/weightwire/round_guard/hold",
            json={"round": "v1"},
            headers={"Authorization": "Bearer k1"},
        )
        assert ok.status_code == 200
        refused = http.post("/v1/completions", json={}, headers={"Authorization": "Bearer k1"})
        assert refused.status_code == 503


MODEL_ROUTES = (
    "/v1/completions",
    "/inference/v1/generate",
    "/invocations",
    "/classify",
    "/pooling",
    "/score",
    "/rerank",
    "/v2/some_new_route",  # a route a later vLLM adds
)


def test_held_guard_refuses_model_routes_to_callers_without_the_key() -> None:
    """vLLM checks the key under some prefixes only: without the key (or with a wrong one)
    a request is refused too, told less."""
    with TestClient(build_app([Worker(WeightState())], api_key=["k1"])) as http:
        held = http.post(
            "/weightwire/round_guard/hold",
            json={"round": "v3", "session": "s9"},
            headers={"Authorization": "Bearer k1"},
        )
        assert held.status_code == 200, held.text
        for headers in ({}, {"Authorization": "Bearer k2"}, {"Authorization": "Basic k1"}):
            for path in MODEL_ROUTES:
                reply = http.post(path, json={}, headers=headers)
                assert reply.status_code == 503, (path, headers, reply.text)
                error = reply.json()["error"]
                assert error["message"] == vllm_guard.ANONYMOUS_MESSAGE
                assert error["reason"] == "weight_round_incomplete" and "round" not in error
                assert "v3" not in reply.text and "s9" not in reply.text
        for path in MODEL_ROUTES:
            reply = http.post(path, json={}, headers={"Authorization": "Bearer k1"})
            assert reply.status_code == 503 and reply.json()["error"]["round"]["round"] == "v3"
        with (
            pytest.raises(WebSocketDisconnect) as closed,
            http.websocket_connect("/v1/realtime") as ws,
        ):
            ws.receive_text()
        assert closed.value.code == 1013
        assert vllm_guard.ANONYMOUS_MESSAGE.startswith(closed.value.reason)
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("headers", "accepted"),
    [
        ([("Authorization", "Bearer k1")], True),
        ([("Authorization", "bearer k1")], True),
        ([("Authorization", "BEARER k1")], True),
        ([("Authorization", "Bearer k1"), ("Authorization", "Bearer nope")], True),
        ([("Authorization", "Bearer nope"), ("Authorization", "Bearer k1")], False),
        ([("Authorization", "Bearer  k1")], False),  # the token is " k1"
        ([("Authorization", "Bearer\tk1")], False),
        ([("Authorization", "Bearer k1x")], False),
        ([("Authorization", "Token k1")], False),
        ([("Authorization", "k1")], False),
        ([], False),
    ],
)
def test_authorization_is_read_as_vllm_reads_it(
    headers: list[tuple[str, str]], accepted: bool
) -> None:
    """vLLM 0.33's --api-key check: the first Authorization header, its scheme compared
    without case up to the first space, the rest the token as it is."""
    with TestClient(build_app([Worker(WeightState())], api_key=["k1", "k2"])) as http:
        reply = http.post("/weightwire/round_guard/hold", json={"round": "v1"}, headers=headers)
        assert reply.status_code == (200 if accepted else 401), reply.text
        scope = {
            "type": "http",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
            "app": http.app,
        }
        assert vllm_guard.asgi.authorized(scope) is accepted


def test_held_guard_passes_only_what_is_known_not_to_run_the_model(http: TestClient) -> None:
    http.post("/weightwire/round_guard/hold", json={"round": "v1"})
    for path in ("/health", "/metrics", "/v1/models", "/weight_info", "/v1/responses/resp_1"):
        assert http.get(path).status_code != 503, path
    assert http.post("/v1/responses/resp_1/cancel").status_code != 503
    assert http.options("/v1/completions").status_code != 503
    for method, path in (
        ("GET", "/v1/some_new_stream"),
        ("PUT", "/v1/completions"),
        ("POST", "/v1/responses/a/b/cancel"),
        ("POST", "/tokenize/more"),
        ("GET", "/v1/responses/a/b"),
    ):
        reply = http.request(method, path, json={})
        assert reply.status_code == 503, (method, path, reply.text)
    # Paths are read inside the app, as vLLM reads them: root_path removed.
    scope = {"type": "http", "method": "POST", "root_path": "/api"}
    assert not vllm_guard.runs_model({**scope, "path": "/api/tokenize"})
    assert vllm_guard.runs_model({**scope, "path": "/api/v1/completions"})
    assert vllm_guard.runs_model({**scope, "method": "GET", "path": "/api/v1/new"})


# ---------------------------------------------------------------- the trainer's side
@contextmanager
def uvicorn_serving(app: FastAPI) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def served(weights: WeightState) -> Iterator[str]:
    with uvicorn_serving(build_app([Worker(weights)])) as url:
        yield url


def in_place_pause(client: HTTPWeightSyncClient) -> RoundPause:
    """The pause a 1 MiB round applied in place (``stage_budget_bytes=0``) gets on ``client``."""
    info = TrainerInitInfo(backend="weightwire_tcp", stage_budget_bytes=0)
    return round_pause(
        info, None, stock_receiver=False, nbytes=1 << 20, client=client, caps=ClientCaps.of(client)
    )


def test_trainer_finds_the_guard_and_holds_it_for_a_round_in_place(
    served: str, weights: WeightState
) -> None:
    with HTTPWeightSyncClient(served, timeout=30) as client:
        state = client.round_guard()[0]
        assert state is not None and state["covers"] is True and state["held"] is False
        pause = in_place_pause(client)
        assert pause == RoundPause("abort", resume_on_failure=False, guard=True)
        client.hold_round("v9")
        weights.broke(None, "worker gave up", frozenset({"w.weight"}))
        after_failed_round(client, pause)  # the guard asks the workers: still refusing
        assert client.round_guard() == [{**state, "held": True, "hold": ANY, "reason": ANY}]
        assert (client.round_guard()[0] or {})["hold"]["round"] == "v9"
        with pytest.raises(WeightSyncError) as err:
            client.release_round(resume=False)
        assert err.value.status == 409 and BROKEN in str(err.value)
        weights.committed(frozenset({"w.weight"}))
        client.release_round(resume=False)
        assert client.round_guard() == [state]


def test_trainer_without_a_guard_warns_with_the_flag(caplog: pytest.LogCaptureFixture) -> None:
    with uvicorn_serving(FastAPI()) as url, HTTPWeightSyncClient(url, timeout=30) as client:
        assert client.round_guard() == [None]  # 404: no guard installed
        pause = in_place_pause(client)
        assert pause == RoundPause("abort", resume_on_failure=False, guard=False)
    assert "start vLLM with --middleware weightwire.vllm_guard.RoundGuard" in caplog.text
    caplog.clear()
    shared = SimpleNamespace(round_guard=lambda: [{"guard": "weightwire", "covers": False}])
    assert guard_installed(shared, ClientCaps.of(shared)) is False
    assert "server(s) [0] run several API-server processes" in caplog.text
    caplog.clear()
    # weightwire's reference server refuses by itself while its model is incomplete: no warning.
    reference = SimpleNamespace(
        round_guard=lambda: [None], version=lambda: "0.33.0+weightwire.0.1.0"
    )
    assert guard_installed(reference, ClientCaps.of(reference)) is False
    assert caplog.text == ""
