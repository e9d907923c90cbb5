"""Sleep mode: ``/sleep`` / ``/wake_up`` / ``/is_sleeping`` on the reference server's real
app (over a one-replica pool whose worker op runs ``ModelSleeper`` on a real module),
and the client's ``sleep`` / ``wake_up`` (query parameters exactly as vLLM reads them)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import torch

from weightwire.control.client import HTTPWeightSyncClient
from weightwire.tools.server.app import ServerOptions, ServerState, create_app
from weightwire.tools.server.sleep import ModelSleeper


class _Replica:
    index, alive, info = 0, True, {}


class OnePool:
    """The pool surface the routes use, with the worker's sleep / wake ops run in process."""

    def __init__(self, sleeper: ModelSleeper) -> None:
        self.sleeper, self.replicas, self.calls = sleeper, [_Replica()], []

    def __len__(self) -> int:
        return 1

    def health(self) -> list[dict[str, Any]]:
        return [{"replica": 0, "alive": True}]

    async def fan_out(
        self, op: str, args: Any = None, *, timeout: float, abort_on_failure: bool = False
    ) -> list[Any]:
        self.calls.append((op, args))
        if op == "sleep":
            return [{"freed_bytes": self.sleeper.sleep(args["level"])}]
        if op == "wake":
            return [{"awake": self.sleeper.wake(args["tags"])}]
        return [None]


def _serve(model: torch.nn.Module) -> tuple[OnePool, ServerState, Any]:
    pool = OnePool(ModelSleeper(model, torch.device("cpu")))
    state = ServerState(pool=pool, options=ServerOptions(backend="weightwire_ipc"))  # type: ignore[arg-type]
    app = create_app(state)

    async def request(method: str, path: str, params: Any = None) -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            return await c.request(method, path, params=params)

    return pool, state, lambda *a, **k: asyncio.run(request(*a, **k))


def test_level_1_offloads_and_wake_restores_exact_weights() -> None:
    model = torch.nn.Linear(8, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pool, state, req = _serve(model)
    r = req("POST", "/sleep", params={"level": 1, "mode": "keep"})
    assert r.status_code == 200 and r.json() == {"status": "sleeping", "level": 1}
    assert state.gate.paused and req("GET", "/is_sleeping").json() == {"is_sleeping": True}
    assert pool.sleeper.level == 1
    r = req("POST", "/wake_up", params=[("tags", "kv_cache")])  # weights still asleep
    assert r.json() == {"status": "sleeping", "tags": ["kv_cache"]} and state.gate.paused
    r = req("POST", "/wake_up")
    assert r.json() == {"status": "awake", "tags": None} and not state.gate.paused
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert req("GET", "/is_sleeping").json() == {"is_sleeping": False}


def test_level_2_discards_weights_and_wake_reallocates_them() -> None:
    model = torch.nn.Linear(8, 4)
    weight = model.weight
    _, _, req = _serve(model)
    assert req("POST", "/sleep", params={"level": 2}).status_code == 200
    assert model.weight is weight and model.weight.numel() == 0  # same Parameter, no storage
    assert req("POST", "/wake_up", params=[("tags", "weights")]).json()["status"] == "awake"
    assert (
        model.weight.shape == (4, 8) and torch.count_nonzero(model.weight) == 0
    )  # a full round must follow


def test_level_0_only_pauses_and_bad_queries_are_422() -> None:
    pool, state, req = _serve(torch.nn.Linear(2, 2))
    assert req("POST", "/sleep", params={"level": 0, "mode": "keep"}).json()["level"] == 0
    assert state.gate.paused and all(op != "sleep" for op, _ in pool.calls)
    assert req("POST", "/wake_up", params=[("tags", "scheduling")]).json()["status"] == "awake"
    assert not state.gate.paused
    for params, needle in (
        ({"level": 3}, "level must be one of [0, 1, 2]"),
        ({"level": "x"}, "level must be"),
        ({"mode": "nap"}, "mode must be one of"),
    ):
        r = req("POST", "/sleep", params=params)
        assert r.status_code == 422 and needle in r.text
    r = req("POST", "/wake_up", params=[("tags", "gpu")])
    assert r.status_code == 422 and "unknown tags ['gpu']" in r.text


def test_client_sends_vllm_query_parameters() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/wake_up":
            return httpx.Response(200, json={"status": "awake", "tags": None})
        return httpx.Response(
            200, json={"is_sleeping": True} if request.method == "GET" else {"status": "sleeping"}
        )

    client = HTTPWeightSyncClient("http://s", transport=httpx.MockTransport(handler))
    client.sleep(2, mode="wait")
    assert client.wake_up(["weights", "kv_cache"]) == [True]
    assert client.is_sleeping() == [True]
    assert str(seen[0].url) == "http://s/version"  # a wait before any init: bounded there?
    assert str(seen[1].url) == "http://s/sleep?level=2&mode=wait"  # no: a stock reply
    assert str(seen[2].url) == "http://s/wake_up?tags=weights&tags=kv_cache"
    with pytest.raises(ValueError, match="sleep level must be one of"):
        client.sleep(3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        client.wake_up(["gpu"])
    with pytest.raises(TypeError, match="not one string"):
        client.wake_up("weights")  # type: ignore[arg-type]
    assert len(seen) == 4  # refused before anything was sent
