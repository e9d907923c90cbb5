"""What the trainer learns of the served model from its servers: an init reply that names
``served_model`` (the reference server), else the workers through vLLM's ``/collective_rpc``
(the weightwire plugin's worker method); each parsed strictly, servers that disagree refused."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from weightwire.control import HTTPWeightSyncClient
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.routes import SERVED_MODEL_METHOD
from weightwire.shared.served import ServedModel
from weightwire.vllm_guard.worker import worker_round_stats, worker_served_model

MODEL = ServedModel.of(
    [ParamMeta("model.embed_tokens.weight", "bfloat16", (8, 4))],
    {"lm_head.weight": "model.embed_tokens.weight"},
)
OTHER = ServedModel.of([ParamMeta("model.embed_tokens.weight", "bfloat16", (9, 4))])


def client(answers: dict[str, Any]) -> tuple[HTTPWeightSyncClient, list[Any]]:
    """Servers a:1 and b:1; ``answers[host]`` is that server's (init reply, rpc answer)."""
    rpc_bodies: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        init, rpc = answers[request.url.host]
        if request.url.path == "/init_weight_transfer_engine":
            return httpx.Response(200, json=init)
        if request.url.path == "/get_world_size":
            return httpx.Response(200, json={"world_size": 1})
        assert request.url.path == "/collective_rpc"
        rpc_bodies.append(json.loads(request.content))
        return rpc if isinstance(rpc, httpx.Response) else httpx.Response(200, json=rpc)

    c = HTTPWeightSyncClient(
        ["http://a:1", "http://b:1"], timeout=5, transport=httpx.MockTransport(handler)
    )
    c.init_weight_transfer_engine({"rank_offset": 1, "world_size": 3})
    return c, rpc_bodies


def told(model: ServedModel) -> dict[str, Any]:
    return {"features": ["served_model"], "served_model": model.to_dict()}


def test_the_init_reply_tells_when_it_names_the_feature() -> None:
    c, _ = client({"a": (told(MODEL), None), "b": (told(MODEL), None)})
    assert c.served_model() == MODEL
    unnamed = {"served_model": MODEL.to_dict()}  # a key without its feature is not read
    c, _ = client({"a": (unnamed, None), "b": (told(MODEL), None)})
    assert c.served_model() is None


def test_servers_that_tell_different_models_are_refused() -> None:
    c, _ = client({"a": (told(MODEL), None), "b": (told(OTHER), None)})
    with pytest.raises(WeightSyncError, match="serves another model than http://a:1"):
        c.served_model()
    bad = {"features": ["served_model"], "served_model": {"tensors": []}}
    c, _ = client({"a": (bad, None), "b": (told(MODEL), None)})
    with pytest.raises(WeightSyncError, match="served_model.tensors must be a non-empty list"):
        c.served_model()


def test_the_workers_tell_through_collective_rpc() -> None:
    answer = {"results": [MODEL.to_dict(), MODEL.to_dict()]}
    c, bodies = client({"a": ({}, answer), "b": ({}, answer)})
    assert c.served_model() is None
    assert c.workers_served_model() == MODEL
    assert bodies == [{"method": SERVED_MODEL_METHOD, "timeout": 5}] * 2


@pytest.mark.parametrize(
    "rpc",
    [
        httpx.Response(404, json={"detail": "Not Found"}),  # no dev mode
        httpx.Response(200),  # vLLM answers a method returning None with no body
        {"results": [MODEL.to_dict(), None]},  # a worker without a weightwire engine
    ],
    ids=["no-route", "no-results", "a-worker-cannot-tell"],
)
def test_workers_that_cannot_tell_tell_nothing(rpc: Any) -> None:
    c, _ = client({"a": ({}, rpc), "b": ({}, {"results": [MODEL.to_dict()]})})
    assert c.workers_served_model() is None


def test_workers_that_disagree_are_refused() -> None:
    c, _ = client({"a": ({}, {"results": [MODEL.to_dict(), OTHER.to_dict()]}), "b": ({}, {})})
    with pytest.raises(WeightSyncError, match="the workers tell different models"):
        c.workers_served_model()
    a, b = {"results": [MODEL.to_dict()]}, {"results": [OTHER.to_dict()]}
    c, _ = client({"a": ({}, a), "b": ({}, b)})
    with pytest.raises(WeightSyncError, match="serves another model than http://a:1"):
        c.workers_served_model()


def test_the_worker_method_asks_its_weightwire_engine() -> None:
    class Engine:
        def served_model(self) -> dict[str, Any]:
            return MODEL.to_dict()

    class Worker:
        weight_transfer_engine: Any = None

    worker = Worker()
    assert worker_served_model(worker) is None  # no engine
    worker.weight_transfer_engine = object()  # vLLM's own engine: cannot tell
    assert worker_served_model(worker) is None
    worker.weight_transfer_engine = Engine()
    assert ServedModel.from_dict(worker_served_model(worker)) == MODEL


def test_the_round_stats_worker_method_asks_its_weightwire_engine() -> None:
    stats = {"rank": 1, "session": "s", "bytes_received": 7, "updates": 1, "committed": True}

    class Engine:
        def round_stats(self) -> dict[str, Any]:
            return stats

    class Worker:
        weight_transfer_engine: Any = None

    worker = Worker()
    assert worker_round_stats(worker) is None  # no engine
    worker.weight_transfer_engine = object()  # vLLM's own engine: counts nothing
    assert worker_round_stats(worker) is None
    worker.weight_transfer_engine = Engine()
    assert worker_round_stats(worker) == stats
