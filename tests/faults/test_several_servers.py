"""Rounds over two reference servers (``weightwire serve``, one client naming both) where one
of them refuses what the other takes: a start refused by one server (asleep) while the other
opened its round leaves no round open there once the trainer gives up (the engine needs a
new init; its shutdown ends that round), and the next engine's round commits on both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import (
    GRACE_S,
    Probe,
    TensorSource,
    assert_weights,
    client_for,
    elapsed,
    engine_for,
    observe,
    quiet_shutdown,
)
from tests.faults.servers import Server, serving
from weightwire.shared.errors import RoundError, WeightSyncError

IN_PLACE = {"stage_budget_bytes": 0}  # a round applied in place: paused as a whole


@pytest.fixture(scope="module")
def second_server(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(fault_model, tmp_path_factory.mktemp("second-server")) as server:
        yield server


@pytest.mark.slow  # ~10 s: a second server process
def test_a_start_one_server_refuses_leaves_no_round_open_on_the_other(
    shared_server: Server, probe: Probe, second_server: Server, source: TensorSource
) -> None:
    """Server A asleep refuses the start (409), server B's start opens B's round (and pauses
    it). The round fails naming A's refusal, and the engine refuses its next round before any
    call (was: kept, so each next round failed on B's "a weight update is already active"
    while opening a round on A, until the round lease, 300 s by default, ended B's);
    ``shutdown()`` ends B's round (its trainer's link closed), and a new engine's round
    commits on both."""
    other = Probe(second_server.url)
    urls = [shared_server.url, second_server.url]
    engine = engine_for(shared_server.url, source, client=client_for(urls), **IN_PLACE)
    try:
        engine.send_weights("both")
        assert probe.http.post("/sleep", params={"level": 1}).status_code == 200
        source.perturb(81)
        with pytest.raises(WeightSyncError, match="asleep") as refused:
            engine.send_weights("one-asleep")
        assert refused.value.route == "start_weight_update" and refused.value.status == 409
        with pytest.raises(RoundError, match="call shutdown\\(\\) and trainer_init\\(\\) again"):
            engine.send_weights("again")  # refused before any call
        observe(refused=str(refused.value))
    finally:
        with elapsed() as took:
            quiet_shutdown(engine)
    assert took[0] < GRACE_S + 2 * 3.0  # B's round ends once it sees the trainer's link closed
    assert other.session()["state"] != "round_active"
    assert probe.session()["state"] != "round_active"
    assert probe.http.post("/wake_up").status_code == 200
    engine = engine_for(shared_server.url, source, client=client_for(urls), **IN_PLACE)
    try:
        want = source.perturb(82)
        engine.send_weights("whole")
        assert_weights(probe, want, "whole")
        assert_weights(other, want, "whole")
        for p in (probe, other):
            assert not p.http.get("/is_paused").json()["is_paused"]  # the commit resumed both
    finally:
        quiet_shutdown(engine)
        other.close()
