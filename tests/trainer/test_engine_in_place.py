"""Rounds the plugin workers apply in place (over ``stage_budget_bytes``; issue #15's
pause defaults): ``auto`` pauses them with ``abort`` (``keep`` becomes ``abort``, ``None`` opts
out), holds the round guard until after the commit, resumes when the round failed before its
start and leaves the server refusing when it failed in place; a round within the budget is
staged and not paused.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.trainer.fakes import FAKE, DictSource, FakeComm, FakeServer, numpy_weights
from tests.trainer.pause_defaults import (
    PROBE,
    ROUND,
    UNPAUSED,
    engine_for,
    round_routes,
    stock_fake_comm,
)
from weightwire.backends.base import SenderCaps
from weightwire.jax_side.dtypes import describe
from weightwire.trainer import TrainerInitInfo


@pytest.fixture(autouse=True)
def fresh_comm(monkeypatch: pytest.MonkeyPatch) -> FakeComm:
    comm = stock_fake_comm(monkeypatch)
    # Every round here goes to a plugin worker (a receiver that is not stock).
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    return comm


def test_auto_pauses_a_round_applied_in_place_with_abort_and_resumes_after_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = FakeServer()
    engine = engine_for(
        server.client(), DictSource(numpy_weights(), describe), stage_budget_bytes=0
    )
    engine.send_weights()
    # No round guard installed: warned, paused all the same.
    assert round_routes(server) == [PROBE, *ROUND]
    assert server.bodies("pause") == [{"mode": "abort"}]  # refusing, not queueing


class FailsOnce(DictSource):
    """Its first pass raises before yielding a tensor (a trainer-side error before any byte)."""

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        self.iterations += 1
        if self.iterations == 1:
            raise RuntimeError("the trainer's weights are not ready")
        yield from self.tensors.items()


def test_a_round_in_place_that_fails_before_its_start_resumes_the_early_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pause goes out beside the round's set-up; a round that fails before its start
    # reached the workers wrote nothing, so generation is resumed, not left refused.
    server = FakeServer()
    engine = engine_for(server.client(), FailsOnce(numpy_weights(), describe), stage_budget_bytes=0)
    with pytest.raises(RuntimeError, match="not ready"):
        engine.send_weights()
    assert round_routes(server) == [PROBE, "pause", "resume"]
    assert "start_weight_update" not in server.routes()
    engine.send_weights()  # the engine stays usable; the next round is whole
    assert round_routes(server)[3:] == ROUND


def test_a_round_in_place_holds_the_round_guard_until_after_the_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = FakeServer()
    server.guard = True
    source = DictSource(numpy_weights(), describe)
    engine = engine_for(server.client(), source, stage_budget_bytes=0)
    engine.send_weights(weight_version="v3")
    assert round_routes(server) == [PROBE, f"{PROBE}/hold", *ROUND, f"{PROBE}/release"]
    assert server.bodies(f"{PROBE}/hold") == [{"round": "v3", "session": None}]
    assert server.bodies(f"{PROBE}/release") == [{"resume": "false"}]  # the trainer resumed itself


def test_a_failed_round_in_place_leaves_the_guard_to_the_workers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = FakeServer()
    server.guard = True
    server.fail["update_weights"] = (500, "worker 0: round failed at chunk 2/3")
    server.fail[f"{PROBE}/release"] = (
        409,
        "not released: worker 0: the model holds an incomplete weight round",
    )
    source = DictSource(numpy_weights(), describe)
    engine = engine_for(server.client(), source, stage_budget_bytes=0)
    with caplog.at_level(logging.ERROR), pytest.raises(Exception, match="round failed at chunk"):
        engine.send_weights()
    routes = round_routes(server)
    assert "resume" not in routes and routes[-1] == f"{PROBE}/release"
    # The guard resumes only if the workers are whole.
    assert server.bodies(f"{PROBE}/release") == [{"resume": "true"}]
    assert "the servers refuse requests that run the model, saying why" in caplog.text


def test_a_round_within_the_budget_is_staged_and_not_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weights = numpy_weights()
    server = FakeServer()
    exact = sum(a.nbytes for a in weights.values())
    engine = engine_for(server.client(), DictSource(weights, describe), stage_budget_bytes=exact)
    engine.send_weights()
    # never paused: a trainer that dies mid-round must not leave the server paused; the
    # reset follows the commit
    assert round_routes(server) == UNPAUSED


@pytest.mark.parametrize("route", ["update_weights", "finish_weight_update"])
def test_a_failed_round_applied_in_place_leaves_the_server_refusing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, route: str
) -> None:
    server = FakeServer()
    server.fail[route] = (500, "worker 0: round failed at chunk 2/3")
    engine = engine_for(
        server.client(), DictSource(numpy_weights(), describe), stage_budget_bytes=0
    )
    with caplog.at_level(logging.ERROR), pytest.raises(Exception, match="round failed at chunk"):
        engine.send_weights()
    assert "resume" not in round_routes(server)
    assert "the servers stay paused" in caplog.text


def test_keep_becomes_abort_for_a_round_applied_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    server = FakeServer()
    engine = engine_for(
        server.client(),
        DictSource(numpy_weights(), describe),
        stage_budget_bytes=0,
        pause_mode="keep",
    )
    engine.send_weights()
    assert server.bodies("pause") == [{"mode": "abort"}]


def test_none_opts_out_of_pausing_a_round_applied_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    server = FakeServer()
    engine = engine_for(
        server.client(),
        DictSource(numpy_weights(), describe),
        stage_budget_bytes=0,
        pause_mode=None,
    )
    engine.send_weights()
    assert round_routes(server) == UNPAUSED  # no pause at all; the cache reset still runs


def test_stage_budget_is_validated_and_reaches_the_workers() -> None:
    from weightwire.backends.tcp.info import TCPInitInfo
    from weightwire.backends.tcp.trainer import TCPBackend

    rdv = TCPBackend().open(
        TrainerInitInfo(backend="weightwire_tcp", stage_budget_bytes=12345), world_size=2
    )
    try:
        assert TCPInitInfo.from_dict(rdv.payload).stage_budget_bytes == 12345
    finally:
        rdv.cancel()
    with pytest.raises(ValueError, match=r"stage_budget_bytes must be an int in \[0, "):
        TrainerInitInfo(stage_budget_bytes=-1)
    with pytest.raises(ValueError, match="stage_budget_bytes must be an int"):
        TrainerInitInfo(stage_budget_bytes=True)


@pytest.mark.parametrize(
    ("urls", "pause", "says"),
    [
        (["http://a:1"], "none", "not paused by this round"),
        (["http://a:1"], "undone", "not paused"),
        (["http://a:1"], "held", "says a pause held before it stays"),
        # another server's start may have paused it: one refusal says nothing of the others
        (["http://a:1", "http://b:1"], "none", "stay paused"),
        (["http://a:1"], None, "may hold part of it"),  # no word: may
        (["http://a:1"], "later", "may hold part of it"),  # a word this version does not know
    ],
    ids=["paused_nothing", "undone", "held_before", "several_servers", "no_word", "unknown"],
)
def test_a_refused_start_that_carried_the_pause_is_logged_as_the_server_said(
    caplog: pytest.LogCaptureFixture, urls: list[str], pause: str | None, says: str
) -> None:
    """After a round in place whose start carried its pause (``START_PAUSES``) and was
    refused, the log says what that refusal's ``pause`` field says of the pause, and only
    for one server. The message's words are for a person: the same words without the
    field say nothing (no text contract between server and trainer)."""
    import types

    from weightwire.shared.errors import WeightSyncError
    from weightwire.trainer.gating import RoundPause, after_failed_round

    client = types.SimpleNamespace(base_urls=urls)
    words = "asleep; this start paused nothing; the pause held before it stays (mode=keep)"
    refused = WeightSyncError("start_weight_update", 409, words, urls[0], pause=pause)
    with caplog.at_level(logging.WARNING, logger="weightwire"):
        after_failed_round(
            client, RoundPause("abort", resume_on_failure=False), refused_start=refused
        )
    assert says in caplog.text
    assert ("stay paused" in caplog.text) is (
        says not in ("not paused by this round", "not paused")
    )
