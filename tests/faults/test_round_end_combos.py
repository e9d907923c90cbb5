"""How a round ends on the real reference server (``weightwire serve``), each a property of the
round checked in combination with the features it meets: what the trainer says of the
servers' pause after a round applied in place whose start (which carried the pause,
``START_PAUSES``) the server refused, and ``shutdown()`` against a server that keeps a round
active."""

from __future__ import annotations

import logging

import pytest

from tests.faults.harness import (
    Probe,
    TensorSource,
    assert_weights,
    engine_for,
    observe,
    quiet_shutdown,
)
from tests.faults.servers import Server
from weightwire.shared.errors import WeightSyncError


def _paused(probe: Probe) -> bool:
    return bool(probe.http.get("/is_paused").json()["is_paused"])


def test_a_refused_start_that_carried_the_pause_logs_the_pause_the_server_left(
    shared_server: Server, probe: Probe, source: TensorSource, caplog: pytest.LogCaptureFixture
) -> None:
    """A round applied in place whose start, carrying its pause, the server refused (asleep):
    the refusal says the start paused nothing, and the trainer says generation is not paused
    by the round (it is not, once awake), never that the servers stay paused; with a pause
    held before the round, both say it stays (it does)."""
    engine = engine_for(shared_server.url, source, stage_budget_bytes=0)
    try:
        want = source.perturb(31)
        engine.send_weights("before")
        assert probe.http.post("/sleep", params={"level": 1}).status_code == 200
        source.perturb(32)
        with (
            caplog.at_level(logging.WARNING, logger="weightwire"),
            pytest.raises(WeightSyncError, match="the server is asleep") as refused,
        ):
            engine.send_weights("refused")
        observe(refused=refused.value.message)
        assert refused.value.route == "start_weight_update"
        assert "this start paused nothing" in refused.value.message
        assert "not paused by this round" in caplog.text and "stay paused" not in caplog.text
        assert probe.http.post("/wake_up").status_code == 200
        assert not _paused(probe)
        caplog.clear()
        assert probe.http.post("/pause", params={"mode": "keep"}).status_code == 200
        assert probe.http.post("/sleep", params={"level": 1}).status_code == 200
        with (
            caplog.at_level(logging.WARNING, logger="weightwire"),
            pytest.raises(WeightSyncError, match="the pause held before it stays"),
        ):
            engine.send_weights("refused-held")
        assert "the servers stay paused" in caplog.text
        assert "says a pause held before it stays" in caplog.text
        assert probe.http.post("/wake_up").status_code == 200
        assert _paused(probe)  # the operator's pause stays
        assert probe.http.post("/resume").status_code == 200
        assert_weights(probe, want, "before")  # nothing of the refused rounds served
        want = source.perturb(33)
        engine.send_weights("after")  # the engine stays usable: no round was opened
        assert_weights(probe, want, "after")
        assert not _paused(probe)
    finally:
        probe.http.post("/wake_up")
        probe.http.post("/resume")
        quiet_shutdown(engine)
