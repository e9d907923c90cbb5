"""``ClientCaps``: the client's optional calls, probed once at ``trainer_init`` (issue #47).

The record must see the calls ``control.fallback.FallbackClient`` forwards through
``__getattr__``: a ``runtime_checkable`` Protocol's ``isinstance`` does not on Python 3.12+,
and would silently drop the pause vLLM's own client gets from its server.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from tests.trainer.fakes import DictSource, FakeComm, FakeServer, numpy_weights
from tests.trainer.pause_defaults import ROUND, engine_for, round_routes, stock_fake_comm
from tests.trainer.test_engine_defaults import FourCalls
from weightwire.control import client as control_client
from weightwire.control.fallback import OPTIONAL_CALLS, FallbackClient, with_fallback_routes
from weightwire.jax_side.dtypes import describe
from weightwire.trainer.caps import ClientCaps


@pytest.fixture(autouse=True)
def fresh_comm(monkeypatch: pytest.MonkeyPatch) -> FakeComm:
    return stock_fake_comm(monkeypatch)


def _fallback_to(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``with_fallback_routes`` asks ``server`` (in process) for the calls it fills in."""
    monkeypatch.setattr(
        control_client, "HTTPWeightSyncClient", lambda url, timeout: server.client(url)
    )


def test_caps_see_the_calls_a_fallback_client_forwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = FakeServer()
    _fallback_to(server, monkeypatch)
    bare = FourCalls(server)
    assert not ClientCaps.of(bare).can_pause
    bare.base_url = "http://fake:8000"  # type: ignore[attr-defined]
    client = with_fallback_routes(bare, timeout=5)
    assert isinstance(client, FallbackClient)
    caps = ClientCaps.of(client)
    offered = {f.name for f in fields(caps) if getattr(caps, f.name)}
    # the four round calls (the user's client) and what the fallback filled in, nothing else:
    # the extra client's round guard or draft route are not the user's client's calls
    round_calls = {"init_weight_transfer_engine", "start_weight_update", "update_weights"}
    assert offered == round_calls | {"finish_weight_update", *OPTIONAL_CALLS}
    assert caps.can_pause and caps.lacks(["round_guard", "pause", "served_model"]) == [
        "round_guard",
        "served_model",
    ]
    client.close()


def test_a_client_of_no_calls_offers_none() -> None:
    caps = ClientCaps.of(None)  # a rank that sends nothing holds no client
    assert caps == ClientCaps() and not caps.can_pause
    half = ClientCaps.of(type("PauseOnly", (), {"pause": lambda self, mode: None})())
    assert half.pause and not half.can_pause  # a pause without its resume is no pause


def test_the_engine_pauses_through_the_calls_the_fallback_filled_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = FakeServer()
    _fallback_to(server, monkeypatch)
    client: Any = FourCalls(server)
    client.base_url = "http://fake:8000"
    engine = engine_for(client, DictSource(numpy_weights(), describe))
    assert isinstance(engine.client, FallbackClient)
    assert engine.session.caps == ClientCaps.of(engine.client)
    engine.send_weights()
    # a stock worker under pause_mode="auto": paused with keep, caches reset, resumed
    assert round_routes(server) == ROUND
    assert server.bodies("pause") == [{"mode": "keep"}]
