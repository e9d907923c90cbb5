"""The order of a round's control calls, where some of them go out at once.

- A round paused as a whole sends its finish and both cache resets together (they must be
  in flight at the same time here: the finish waits for both resets to arrive) and resumes
  only after all three returned; an unpaused round keeps finish, then the resets.
- A failed reset there is still a committed round (``StaleCacheError``) that resumes; a
  failed finish is a failed round, whatever the resets said.
- With the pause sent early, the start follows it from the helper thread, without waiting
  for the first chunk to be packed; a round that fails once that start went out counts
  as started. To a plugin worker (whose start touches no weight) the pause and the start
  are in flight at once, both answered before the update; a stock worker keeps pause, then
  start.
- Where every server offers a start that pauses first and a finish that also resets the
  caches and resumes (weightwire's reference server), a paused round is those calls and the
  update; a failed one leaves the resume to the round's own rule; an unpaused round's
  finish resets the caches in the same request (and resumes nothing).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.trainer.fakes import (
    FAKE,
    FAST,
    DictSource,
    FakeComm,
    FakeServer,
    numpy_weights,
)
from tests.trainer.pause_defaults import UNPAUSED
from weightwire.backends.base import SenderCaps, SenderParts
from weightwire.backends.pipelines import host_sender
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.client import CONTROL_CALLS, ROUND_CALLS
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.routes import FINISH_RESETS_RESUMES, START_PAUSES
from weightwire.trainer import TrainerInitInfo
from weightwire.trainer.engine import EngineBroken
from weightwire.trainer.freshness import StaleCacheError

COMMIT = ("finish_weight_update", "reset_prefix_cache", "reset_encoder_cache")
WAIT_S = 5.0  # a bound on waits that only a broken ordering would reach


@pytest.fixture(autouse=True)
def fresh_comm() -> None:
    FAKE.comm = FakeComm()


def stock_backend(monkeypatch: pytest.MonkeyPatch, stock: bool = True) -> None:
    """The fake backend as a stock worker (``auto`` pauses the whole round) or a staging one."""
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=stock))


def engine_for(client: Any, **info: Any) -> JAXTrainerEngine:
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST, **info),
        client=client,
        source=DictSource(numpy_weights(), describe),
    )


def failing_round(
    monkeypatch: pytest.MonkeyPatch, server: FakeServer, route: str, status: int, error: str
) -> JAXTrainerEngine:
    """A stock worker's round whose ``route`` answers ``status`` with ``error``: the round
    raises naming it. The engine, for what the test checks next."""
    stock_backend(monkeypatch)
    server.fail[route] = (status, error)
    engine = engine_for(server.client())
    with pytest.raises(WeightSyncError, match=error):
        engine.send_weights()
    return engine


class Timeline:
    """A client (no HTTP) that logs each call's entry and exit, in the order they happened.

    ``concurrent_commit``: the finish returns only once both resets were entered, so a round
    that sends them one after another fails (``BrokenBarrierError``, bounded)."""

    def __init__(self, *, concurrent_commit: bool = False) -> None:
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.fail: dict[str, Exception] = {}
        self.barrier = threading.Barrier(3, timeout=WAIT_S) if concurrent_commit else None

    def __getattr__(self, name: str) -> Any:
        if name not in (*ROUND_CALLS, *CONTROL_CALLS):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.events.append(("enter", name))
            try:
                if self.barrier is not None and name in COMMIT:
                    self.barrier.wait()  # all three in flight at once
                if name in self.fail:
                    raise self.fail[name]
                return {"version": "0.33.0", "get_world_size": 1, "reset_prefix_cache": [True]}.get(
                    name
                )
            finally:
                with self.lock:
                    self.events.append(("exit", name))

        return call

    def at(self, kind: str, name: str, nth: int = 0) -> int:
        """Index of the ``nth`` ``kind`` event of ``name``."""
        hits = [i for i, e in enumerate(self.events) if e == (kind, name)]
        assert len(hits) > nth, f"no {kind} of {name} #{nth} in {self.events}"
        return hits[nth]


def test_a_paused_round_sends_finish_and_resets_at_once_and_resumes_after_all_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch)
    client = Timeline(concurrent_commit=True)
    engine = engine_for(client)
    engine.send_weights(weight_version="v1")
    engine.send_weights(weight_version="v2")
    for nth in (0, 1):
        resume = client.at("enter", "resume", nth)
        update_done = client.at("exit", "update_weights", nth)
        for name in COMMIT:
            assert update_done < client.at("enter", name, nth)
            assert client.at("exit", name, nth) < resume  # never resumed before all returned
    assert client.events.count(("enter", "resume")) == 2


def test_an_unpaused_round_keeps_finish_then_the_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    stock_backend(monkeypatch, stock=False)  # a staging worker: auto does not pause
    client = Timeline()
    engine_for(client).send_weights()
    assert ("enter", "pause") not in client.events
    finish_done = client.at("exit", "finish_weight_update")
    assert finish_done < client.at("enter", "reset_prefix_cache")
    assert client.at("exit", "reset_prefix_cache") < client.at("enter", "reset_encoder_cache")


def test_a_failed_reset_in_a_paused_round_is_committed_and_still_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch)
    client = Timeline(concurrent_commit=True)
    client.fail["reset_encoder_cache"] = WeightSyncError("reset_encoder_cache", 500, "boom", "s")
    engine = engine_for(client)
    with pytest.raises(StaleCacheError, match="reset_encoder_cache failed") as caught:
        engine.send_weights(weight_version="v1")
    assert caught.value.committed and caught.value.weight_version == "v1"
    resume = client.at("enter", "resume")
    assert all(client.at("exit", name) < resume for name in COMMIT)
    client.fail.clear()
    assert engine.send_weights().version == "2"  # committed: the count moved on


def test_a_failed_finish_fails_the_paused_round_whatever_the_resets_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch)
    client = Timeline(concurrent_commit=True)
    client.fail["finish_weight_update"] = WeightSyncError(
        "finish_weight_update", 500, "worker exploded", "s"
    )
    client.fail["reset_prefix_cache"] = WeightSyncError("reset_prefix_cache", 500, "also", "s")
    engine = engine_for(client)
    with pytest.raises(WeightSyncError, match="worker exploded") as caught:
        engine.send_weights(weight_version="v1")
    assert not isinstance(caught.value, StaleCacheError)  # not committed
    resume = client.at("enter", "resume")  # the pause's own rule: a failed round resumes
    assert all(client.at("exit", name) < resume for name in COMMIT)
    client.fail.clear()
    assert engine.send_weights().version == "1"  # not committed: the count did not move


# -- the early start ---------------------------------------------------------------------------


class Gated:
    """A backend whose first chunk's packing (``host_bytes``) runs ``gate`` first."""

    def __init__(self, gate: Any) -> None:
        self.gate, self.calls = gate, 0

    def sender(self, link: Any, settings: Any, parts: SenderParts) -> Any:
        host_bytes = parts.host_bytes

        def gated(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                self.gate()
            return host_bytes(tensors, *args, **kwargs)

        return host_sender(link, settings, SenderParts(gated, parts.prefetch, parts.packer))


def gated_engine(
    monkeypatch: pytest.MonkeyPatch, server: FakeServer, gate: Any, **info: Any
) -> JAXTrainerEngine:
    monkeypatch.setattr(type(FAKE), "sender", lambda self, *a: Gated(gate).sender(*a))
    return engine_for(server.client(), **info)


def start_watched(
    monkeypatch: pytest.MonkeyPatch, stock: bool = True
) -> tuple[FakeServer, threading.Event]:
    """The fake backend as ``stock_backend`` makes it, and a server with an event set once its
    start arrives."""
    stock_backend(monkeypatch, stock)
    server = FakeServer()
    started = threading.Event()
    server.hooks["start_weight_update"] = lambda _: started.set()
    return server, started


def round_routes(server: FakeServer) -> list[str]:
    return [r for r in server.routes() if r not in ("version", "get_world_size")][1:]


def test_the_start_follows_the_early_pause_before_the_first_chunk_is_packed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, started = start_watched(monkeypatch)
    threads: dict[str, str] = {}
    for route in ("pause", "start_weight_update"):
        server.hooks.setdefault(route, lambda _: None)
        hook = server.hooks[route]
        server.hooks[route] = lambda b, r=route, h=hook: (
            threads.setdefault(r, threading.current_thread().name),
            h(b),
        )

    def gate() -> None:  # the start must not wait for this packing: it comes first
        assert started.wait(WAIT_S), "the start waited for the first chunk's packing"

    engine = gated_engine(monkeypatch, server, gate)
    engine.send_weights()
    assert threads["pause"] == threads["start_weight_update"] == "weightwire-pause-start"
    assert round_routes(server)[:3] == ["pause", "start_weight_update", "update_weights"]


def test_a_round_failing_after_its_early_start_counts_as_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, started = start_watched(monkeypatch)

    def gate() -> None:
        assert started.wait(WAIT_S)
        raise RuntimeError("packing failed")

    engine = gated_engine(monkeypatch, server, gate)
    with pytest.raises(RuntimeError, match="packing failed"):
        engine.send_weights()
    # Started: the round's failure rule (a stock round resumes), no update, and the engine
    # refuses further rounds (the servers hold a round it will never finish).
    assert round_routes(server) == ["pause", "start_weight_update", "resume"]
    with pytest.raises(EngineBroken, match="packing failed"):
        engine.send_weights()


def test_a_round_in_place_failing_after_its_early_start_stays_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, started = start_watched(monkeypatch, stock=False)

    def gate() -> None:
        assert started.wait(WAIT_S)
        raise RuntimeError("packing failed")

    engine = gated_engine(monkeypatch, server, gate, stage_budget_bytes=0)
    with pytest.raises(RuntimeError, match="packing failed"):
        engine.send_weights()
    # Applied in place and started: the workers may hold part of it, so no resume. A plugin
    # worker's pause goes beside its start, so the two arrive in either order.
    assert sorted(round_routes(server)[1:]) == ["pause", "start_weight_update"]


def test_a_refused_early_start_fails_the_round_and_leaves_the_engine_usable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = FakeServer()
    engine = failing_round(
        monkeypatch, server, "start_weight_update", 409, "a weight update is already active"
    )
    assert round_routes(server) == ["pause", "start_weight_update", "resume"]
    del server.fail["start_weight_update"]
    assert engine.send_weights().version == "1"  # nothing opened: usable, nothing committed


class PauseBesideStart(Timeline):
    """The start returns only once the pause was entered too (and the pause once the start
    was): a round that sends them one after another fails (``BrokenBarrierError``, bounded)."""

    def __init__(self) -> None:
        super().__init__()
        self.both = threading.Barrier(2, timeout=WAIT_S)

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)
        if name not in ("pause", "start_weight_update"):
            return call

        def met(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.events.append(("enter", name))
            self.both.wait()
            return call(*args, **kwargs)

        return met


def test_an_in_place_round_to_a_plugin_worker_sends_pause_and_start_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch, stock=False)
    client = PauseBesideStart()
    engine = engine_for(client, stage_budget_bytes=0)  # in place: paused with abort
    engine.send_weights(weight_version="v1")
    engine.send_weights(weight_version="v2")
    for nth in (0, 1):
        update = client.at("enter", "update_weights", nth)
        # both answered before the update (and so before any byte)
        assert client.at("exit", "pause", nth) < update
        assert client.at("exit", "start_weight_update", nth) < update


def test_a_failed_pause_beside_an_opened_start_breaks_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch, stock=False)
    client = Timeline()
    client.fail["pause"] = WeightSyncError("pause", 500, "pause broke", "s")
    engine = engine_for(client, stage_budget_bytes=0)
    with pytest.raises(WeightSyncError, match="pause broke"):
        engine.send_weights()
    assert ("enter", "update_weights") not in client.events  # no byte, no update
    # the servers hold a round this trainer will send nothing into: a new init is needed
    with pytest.raises(EngineBroken, match="pause broke"):
        engine.send_weights()


def test_a_failed_early_pause_sends_no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    server = FakeServer()
    failing_round(monkeypatch, server, "pause", 500, "pause broke")
    assert round_routes(server) == ["pause"]
    assert FAKE.comm.broadcasts == []


# -- a server whose finish also resets and resumes (weightwire's reference server) -------------


class Advertising(FakeServer):
    """Names ``START_PAUSES`` and ``FINISH_RESETS_RESUMES`` at init and honours the finish's
    (a start's ``pause`` is recorded as its body)."""

    def __init__(self, features: tuple[str, ...] = (START_PAUSES, FINISH_RESETS_RESUMES)) -> None:
        super().__init__()
        self.features = list(features)

    def handler(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path.lstrip("/")
        if route == "init_weight_transfer_engine":
            super().handler(request)
            return httpx.Response(200, json={"features": self.features})
        if route != "finish_weight_update" or not request.url.query:
            return super().handler(request)
        body = json.loads(request.content)
        with self.lock:
            self.calls.append((route, {**body, **dict(request.url.params)}))
        if route in self.fail:
            status, message = self.fail[route]
            return httpx.Response(status, json={"error": message})
        self.weight_version = body["weight_version"]
        return httpx.Response(200, json={"caches_reset": True, "resumed": True})


def test_a_paused_round_is_three_calls_where_the_server_offers_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch)
    server = Advertising()
    engine_for(server.client()).send_weights(weight_version="v1")
    assert round_routes(server) == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert server.bodies("start_weight_update") == [{"pause": "keep"}]
    assert server.bodies("finish_weight_update") == [
        {"weight_version": "v1", "reset_caches": "true", "resume": "true"}
    ]
    assert server.weight_version == "v1"


def test_a_failed_finish_in_one_call_gets_the_rounds_own_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = Advertising()
    failing_round(monkeypatch, server, "finish_weight_update", 500, "worker exploded")
    assert round_routes(server)[-2:] == ["finish_weight_update", "resume"]


def test_an_unpaused_round_resets_in_its_finish_where_one_is_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch, stock=False)
    server = Advertising()
    engine_for(server.client()).send_weights(weight_version="v1")
    assert round_routes(server) == ["start_weight_update", "update_weights", "finish_weight_update"]
    assert server.bodies("finish_weight_update") == [
        {"weight_version": "v1", "reset_caches": "true", "resume": "false"}  # no pause held
    ]


def test_an_unpaused_round_keeps_separate_calls_where_none_is_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch, stock=False)
    server = Advertising(())
    engine_for(server.client()).send_weights()
    assert round_routes(server) == UNPAUSED


def test_only_the_finish_is_combined_where_only_it_is_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stock_backend(monkeypatch)
    server = Advertising((FINISH_RESETS_RESUMES,))
    engine_for(server.client()).send_weights()
    assert round_routes(server) == [
        "pause",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]


def test_a_failed_start_that_pauses_counts_as_paused_and_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = Advertising()
    engine = failing_round(monkeypatch, server, "start_weight_update", 500, "worker refused")
    # The server may have paused before its start failed: the round's rule resumes it.
    assert round_routes(server) == ["start_weight_update", "resume"]
    del server.fail["start_weight_update"]
    assert engine.send_weights().version == "1"  # a failed start opened nothing: usable


def test_several_servers_keep_separate_finish_calls_even_where_each_offers_one() -> None:
    from types import SimpleNamespace

    from weightwire.trainer.caps import ClientCaps
    from weightwire.trainer.freshness import finishes_with_resume

    def client(urls: list[str]) -> Any:
        return SimpleNamespace(base_urls=urls, finishes_with_resume=lambda: True)

    one, both = client(["http://a:1"]), client(["http://a:1", "http://b:1"])
    assert finishes_with_resume(one, ClientCaps.of(one))
    # One server's commit must not resume it while another's failed finish keeps the old weights.
    assert not finishes_with_resume(both, ClientCaps.of(both))
