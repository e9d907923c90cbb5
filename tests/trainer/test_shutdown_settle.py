"""``shutdown()`` against a server that keeps answering 409 (a round still active there): the
retries and the wait for them are one bound (``transfer.settle_bound``), the error is a
``ControlTimeout`` naming ``shutdown_weight_transfer_engine`` and the server's answer, and no
retry goes out once ``shutdown()`` returned (a poll the caller stopped waiting for ends)."""

from __future__ import annotations

import threading
import time
import types

import pytest

from tests.trainer.fakes import DictSource, FakeServer, numpy_weights
from tests.trainer.pause_defaults import stock_fake_comm
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.errors import ControlTimeout
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer import TrainerInitInfo, transfer

ROUTE = "shutdown_weight_transfer_engine"
ACTIVE = (409, "shutdown_weight_transfer_engine refused: a weight update is active (round 3)")
TRANSFER_S, GRACE_S = 0.4, 0.2
BOUND = 2 * TRANSFER_S + GRACE_S
SLACK_S = 4.0
"""How far past ``BOUND`` shutdown() may raise: a loaded 2-core box's thread wake-ups, far
below what a missed bound costs (the client's 10 s http_s, a call held 30 s)."""


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    stock_fake_comm(monkeypatch)
    monkeypatch.setattr(transfer, "_GRACE_S", GRACE_S)


def _engine(server: FakeServer) -> JAXTrainerEngine:
    timeouts = Timeouts(http_s=10, connect_s=5, warmup_s=5, transfer_s=TRANSFER_S)
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=timeouts),
        client=server.client(),
        source=DictSource(numpy_weights(), describe),
    )


def _calls(server: FakeServer) -> int:
    return len(server.bodies(ROUTE))


def test_a_server_that_keeps_its_round_active_fails_shutdown_by_name_within_the_bound() -> None:
    server = FakeServer()
    engine = _engine(server)
    server.fail[ROUTE] = ACTIVE
    began = time.monotonic()
    with pytest.raises(ControlTimeout) as got:
        engine.shutdown()
    took = time.monotonic() - began
    assert got.value.route == ROUTE
    assert "the server still had a round active" in got.value.message
    assert "a weight update is active (round 3)" in got.value.message  # its last answer
    assert _calls(server) > 2  # retried meanwhile
    assert BOUND - 0.2 <= took < BOUND + SLACK_S, took
    calls = _calls(server)
    time.sleep(0.3)
    assert _calls(server) == calls  # nothing polls after shutdown() raised


def test_a_poll_too_late_for_the_bound_still_names_the_servers_last_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The poll never sees the bound itself (its clock stands still: a box too loaded to run
    its thread in time): at the bound shutdown() halts it between two calls and raises its
    verdict, naming the server's last answer (was: a bare "did not return within 0.99998 s",
    whenever the poll thread had not run by the bound, as under two test runs at once)."""
    server = FakeServer()
    engine = _engine(server)
    server.fail[ROUTE] = ACTIVE
    monkeypatch.setattr(
        transfer,
        "time",
        types.SimpleNamespace(monotonic=lambda: 0.0, perf_counter=time.perf_counter),
    )
    began = time.monotonic()
    with pytest.raises(ControlTimeout) as got:
        engine.shutdown()
    took = time.monotonic() - began
    assert got.value.route == ROUTE
    assert "the server still had a round active" in got.value.message, got.value.message
    assert "a weight update is active (round 3)" in got.value.message
    assert BOUND - 0.2 <= took < BOUND + SLACK_S, took
    calls = _calls(server)
    time.sleep(0.3)
    assert _calls(server) == calls  # halted: nothing polls after shutdown() raised


def test_a_retry_still_out_at_the_bound_is_abandoned_and_calls_no_more() -> None:
    """A call that answers only past the bound: shutdown() raises at the bound, naming the
    route; the poll left behind takes that late 409 and sends nothing after it."""
    server = FakeServer()
    engine = _engine(server)
    server.fail[ROUTE] = ACTIVE
    late, answered = threading.Event(), threading.Event()

    def hold_the_second(_: object) -> None:
        if _calls(server) == 2:
            late.wait(30.0)  # out past the bound, until the test lets it answer
            answered.set()

    server.hooks[ROUTE] = hold_the_second
    began = time.monotonic()
    try:
        with pytest.raises(ControlTimeout, match=ROUTE) as got:
            engine.shutdown()
        took = time.monotonic() - began
    finally:
        late.set()
    assert got.value.route == ROUTE and "did not return within" in got.value.message
    assert took < BOUND + SLACK_S, took
    assert answered.wait(5.0)
    time.sleep(0.3)
    assert _calls(server) == 2  # the abandoned poll took its late 409 and stopped


def test_stock_vllms_refusal_while_its_update_is_active_is_retried_until_it_ends() -> None:
    """Stock vLLM's worker refuses a shutdown with a 500 while its update is active (the
    update POST of a round the trainer gave up may land just after the shutdown): retried as
    the 409 is, so the shutdown lands once the update failed on the closed link."""
    server = FakeServer()
    engine = _engine(server)
    server.fail[ROUTE] = (
        500,
        "Call to collective_rpc method failed: Cannot release a trainer connection during a "
        "weight update",
    )

    def update_failed_by_the_retry(_: object) -> None:
        if _calls(server) == 2:  # counted, not timed: the retry finds the update gone
            server.fail.pop(ROUTE)

    server.hooks[ROUTE] = update_failed_by_the_retry
    engine.shutdown()  # no error: the refusal ended within the bound
    assert _calls(server) == 2
