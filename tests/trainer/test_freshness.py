"""After a committed round nothing a server serves comes from the previous weights.

The route sequence rank 0 sends per backend kind and pause mode (stock ``nccl`` is
stood in for by the fake backend with ``stock_receiver``), the opt-out, the fan-out to
every data-parallel replica, and what a failed reset does: the round stays committed
and the caller gets a ``StaleCacheError`` that says so, never silence.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from tests.trainer.fakes import FAKE, FAST, DictSource, FakeComm, FakeServer, numpy_weights
from weightwire.backends.base import SenderCaps
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.client import CONTROL_CALLS, ROUND_CALLS
from weightwire.shared.errors import WeightwireError
from weightwire.trainer import TrainerInitInfo
from weightwire.trainer.freshness import StaleCacheError

RESET = ["reset_prefix_cache", "reset_encoder_cache"]
SETUP = ("version", "get_world_size", "init_weight_transfer_engine")


@pytest.fixture(autouse=True)
def fresh_comm() -> None:
    FAKE.comm = FakeComm()


@pytest.fixture(params=[False, True], ids=["plugin", "stock"])
def stock(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(
        type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=request.param)
    )
    return bool(request.param)


def engine_for(client: Any, **info: Any) -> JAXTrainerEngine:
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST, **info),
        client=client,
        source=DictSource(numpy_weights(), describe),
    )


def assert_paused_round(calls: list[str]) -> None:
    """A round paused as a whole: the finish and both resets between the update and the
    resume, in whatever order they reached the client (they go out at once)."""
    assert calls[:3] == ["pause", "start_weight_update", "update_weights"], calls
    assert sorted(calls[3:6]) == sorted(["finish_weight_update", *RESET]), calls
    assert calls[6:] == ["resume"], calls


class Recorder:
    """A client that is no HTTP client: every call it gets, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.answers: dict[str, Any] = {
            "version": "0.33.0",
            "get_world_size": 1,
            "reset_prefix_cache": [True],
        }

    def __getattr__(self, name: str) -> Any:
        if name not in (*ROUND_CALLS, *CONTROL_CALLS):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return self.answers.get(name)

        return call

    def rounds(self) -> list[str]:
        return [name for name, _, _ in self.calls if name not in SETUP]


def test_stock_round_resets_before_it_resumes_and_a_plugin_round_resets_right_after_its_commit(
    stock: bool,
) -> None:
    client = Recorder()
    engine_for(client).send_weights(weight_version="v1")
    if stock:  # the whole round is paused (a layerwise reload must not meet a request)
        assert_paused_round(client.rounds())
        pause = next(c for c in client.calls if c[0] == "pause")
        assert pause[1:] == (("keep",), {})
    else:
        # staged: never paused (a trainer dying mid-round must not leave vLLM paused); reset
        # once the commit returned
        want = ["start_weight_update", "update_weights", "finish_weight_update", *RESET]
        assert client.rounds() == want
    assert next(c for c in client.calls if c[0] == "finish_weight_update")[1] == ("v1",)


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_an_explicit_pause_mode_holds_the_whole_round_and_the_reset(stock: bool, mode: str) -> None:
    client = Recorder()
    engine_for(client, pause_mode=mode).send_weights()
    assert_paused_round(client.rounds())
    assert [c[1] for c in client.calls if c[0] == "pause"] == [(mode,)]


def test_opt_out_sends_no_reset_and_no_commit_pause(
    stock: bool, caplog: pytest.LogCaptureFixture
) -> None:
    client = Recorder()
    with caplog.at_level(logging.INFO, logger="weightwire.trainer"):
        engine_for(client, reset_prefix_cache=False).send_weights()
    core = ["start_weight_update", "update_weights", "finish_weight_update"]
    assert client.rounds() == (["pause", *core, "resume"] if stock else core)
    assert (
        "reset_prefix_cache=False: vLLM may answer requests from KV computed before a round"
        in caplog.text
    )
    assert TrainerInitInfo().reset_prefix_cache is True
    with pytest.raises(ValueError, match="reset_prefix_cache must be a bool, got 'no'"):
        TrainerInitInfo(reset_prefix_cache="no")  # type: ignore[arg-type]


def test_a_client_without_the_reset_is_refused_before_any_rendezvous() -> None:
    class NoReset(Recorder):
        def __getattr__(self, name: str) -> Any:
            if name in ("reset_prefix_cache", "reset_encoder_cache"):
                raise AttributeError(name)
            return super().__getattr__(name)

    client = NoReset()
    FAKE.opened.clear()
    with pytest.raises(
        TypeError, match="lacks reset_prefix_cache .*reset_prefix_cache=False accepts that"
    ):
        engine_for(client)
    assert client.calls == [] and FAKE.opened == []


class Replicas:
    """Several fake servers behind one transport, told apart by host."""

    def __init__(self, n: int) -> None:
        self.servers = {f"r{i}": FakeServer() for i in range(n)}

    def handler(self, request: httpx.Request) -> httpx.Response:
        return self.servers[request.url.host].handler(request)

    def client(self) -> HTTPWeightSyncClient:
        urls = [f"http://{host}:8000" for host in self.servers]
        return HTTPWeightSyncClient(urls, timeout=10, transport=httpx.MockTransport(self.handler))


def test_every_data_parallel_replica_is_reset_after_the_commit() -> None:
    replicas = Replicas(3)
    engine = engine_for(replicas.client())
    engine.send_weights()
    engine.send_weights()
    for server in replicas.servers.values():
        routes = [r for r in server.routes() if r not in SETUP]
        assert (
            routes == ["start_weight_update", "update_weights", "finish_weight_update", *RESET] * 2
        )
        assert (
            server.bodies("reset_prefix_cache")
            == [{"reset_running_requests": "true", "reset_external": "true"}] * 2
        )


def test_a_failed_reset_leaves_the_round_committed_says_so_and_resumes() -> None:
    replicas = Replicas(2)
    bad = replicas.servers["r1"]
    bad.fail["reset_prefix_cache"] = (
        500,
        "Failed to reset KV cache even when all the running requests are preempted",
    )
    engine = engine_for(replicas.client())
    with pytest.raises(StaleCacheError) as caught:
        engine.send_weights(weight_version="v1")
    err = caught.value
    assert isinstance(err, WeightwireError) and err.committed and err.weight_version == "v1"
    message = str(err)
    assert message.startswith(
        "round 'v1' was committed (finish_weight_update returned), but the servers' caches "
        "were not reset: reset_prefix_cache failed on http://r1:8000 (status 500): Failed to"
    )
    assert "may be answered from KV computed with the previous weights" in message
    assert "reset_prefix_cache=False" in message
    for server in replicas.servers.values():  # committed everywhere, and nobody left paused
        assert server.weight_version == "v1" and "pause" not in server.routes()
    del bad.fail["reset_prefix_cache"]
    assert (
        engine.send_weights().version == "2"
    )  # the engine stays usable; the count moved on at the commit


def test_a_server_without_the_route_names_dev_mode() -> None:
    server = FakeServer()
    server.fail["reset_prefix_cache"] = (404, "Not Found")
    with pytest.raises(
        StaleCacheError,
        match="no /reset_prefix_cache route; vLLM serves it with VLLM_SERVER_DEV_MODE",
    ):
        engine_for(server.client()).send_weights()
    assert server.weight_version == "1" and "pause" not in server.routes()


def test_success_false_is_retried_then_reported() -> None:
    server = FakeServer()
    answers = iter([False, True])
    original = server.handler

    def flaky(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/reset_prefix_cache":
            server.calls.append(("reset_prefix_cache", dict(request.url.params)))
            return httpx.Response(200, json={"success": next(answers, False)})
        return original(request)

    client = HTTPWeightSyncClient(
        "http://fake:8000", timeout=10, transport=httpx.MockTransport(flaky)
    )
    engine = engine_for(client)
    engine.send_weights()  # false once, then true: done
    assert server.routes().count("reset_prefix_cache") == 2
    with pytest.raises(
        StaleCacheError,
        match=r"server\(s\) 0 answered success=false to /reset_prefix_cache 3 times",
    ):
        engine.send_weights()
    assert server.routes().count("reset_prefix_cache") == 5 and "pause" not in server.routes()


def test_a_failed_encoder_reset_is_reported_too() -> None:
    server = FakeServer()
    server.fail["reset_encoder_cache"] = (500, "boom")
    with pytest.raises(
        StaleCacheError,
        match="reset_encoder_cache failed .*encoder outputs may come from the previous",
    ):
        engine_for(server.client()).send_weights()


def test_a_server_without_pause_routes_is_reset_all_the_same() -> None:
    server = FakeServer()
    server.fail["pause"] = (
        404,
        "Not Found",
    )  # a staged plugin round never pauses: the route is not needed
    engine = engine_for(server.client())
    engine.send_weights()
    engine.send_weights()
    unpaused = ["start_weight_update", "update_weights", "finish_weight_update", *RESET]
    assert [r for r in server.routes() if r not in SETUP] == unpaused * 2


def test_http_client_reset_reads_success_per_server() -> None:
    replies = {"a": {"success": True}, "b": {"success": False}, "c": {"message": "ok"}}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.method == "POST" and request.url.path == "/reset_prefix_cache"
        assert dict(request.url.params) == {
            "reset_running_requests": "false",
            "reset_external": "true",
        }
        return httpx.Response(200, content=json.dumps(replies[request.url.host]).encode())

    client = HTTPWeightSyncClient(
        ["http://a:1", "http://b:1", "http://c:1"], transport=httpx.MockTransport(handler)
    )
    assert client.reset_prefix_cache(reset_running_requests=False) == [True, False, False]


class Finishing:
    """A one-server client whose update also finishes (``UPDATE_FINISHES``), answering
    ``reply`` (a server's reply to such an update)."""

    base_urls = ["http://ref:1"]

    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply
        self.asked: list[tuple[str | None, bool, bool]] = []

    def updates_with_finish(self) -> bool:
        return True

    def update_and_finish(
        self, payload: Any, version: str | None, *, reset_caches: bool, resume: bool
    ) -> list[dict[str, Any]]:
        self.asked.append((version, reset_caches, resume))
        return [self.reply]


def _finish(client: Any, paused: bool = True, **caps: bool) -> Any:
    from weightwire.trainer.caps import ClientCaps
    from weightwire.trainer.freshness import finish_in_update

    offered = ClientCaps(**{"updates_with_finish": True, **caps})
    return finish_in_update(client, offered, "v1", reset=True, paused=lambda: paused, single=True)


def test_an_update_that_finished_is_the_commit_its_resume_and_reset_read_from_its_reply() -> None:
    from weightwire.shared.errors import WeightSyncError

    ok = Finishing({"weight_version": "v1", "caches_reset": True, "resumed": True})
    finish = _finish(ok)
    finish.post({"names": []})
    recorded: list[bool] = []
    assert finish.posted and ok.asked == [("v1", True, True)]
    assert finish.committed(lambda: recorded.append(True)) is True and recorded == [True]
    # asleep: committed (recorded), the resume refused as a failed /resume
    asleep = Finishing({"caches_reset": True, "resumed": False, "resume_error": "asleep"})
    finish = _finish(asleep)
    finish.post({})
    with pytest.raises(WeightSyncError, match="asleep") as got:
        finish.committed(lambda: recorded.append(True))
    assert got.value.route == "resume" and recorded == [True, True]
    # the caches not reset: committed all the same, said so
    stale = Finishing({"caches_reset": False})
    finish = _finish(stale, paused=False)
    finish.post({})
    with pytest.raises(StaleCacheError):
        finish.committed(lambda: recorded.append(True))
    assert stale.asked == [("v1", True, False)] and len(recorded) == 3


def test_the_finish_rides_on_the_update_only_for_one_server_that_offers_it() -> None:
    from weightwire.trainer.caps import ClientCaps
    from weightwire.trainer.freshness import finish_in_update

    one = Finishing({})
    assert _finish(one) is not None
    assert _finish(one, updates_with_finish=False) is None  # not offered
    two = Finishing({})
    two.base_urls = ["http://a:1", "http://b:1"]  # type: ignore[misc]
    assert _finish(two) is None  # one server could commit while the other's update failed
    caps = ClientCaps(updates_with_finish=True)
    kw: dict[str, Any] = {"reset": True, "paused": lambda: True}
    assert finish_in_update(one, caps, "v", single=False, **kw) is None  # several updates
