"""A finish that cannot commit in time: what the server reports and what it serves agree.

Own server with ``--op-timeout 1`` and a decode step delay (``HOLD_ARGS``): a generation
holds the model when the round's finish arrives, on any machine, until the case aborts it.
The finish must answer within its op timeout (not when the generation ends) and, having
answered "not committed", must never commit later.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import (
    AUTH,
    GRACE_S,
    HOLD_ARGS,
    Probe,
    TensorSource,
    assert_weights,
    elapsed,
    engine_for,
    fresh_round,
    observe,
    quiet_shutdown,
)
from tests.faults.servers import Server, serving
from tests.server._server_sender import released, running_generation
from weightwire.shared.errors import WeightSyncError

pytestmark = pytest.mark.timeout(180)
OP_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(
        fault_model,
        tmp_path_factory.mktemp("commit-faults"),
        "--op-timeout",
        str(OP_TIMEOUT_S),
        *HOLD_ARGS,
    ) as s:
        yield s


def test_finish_blocked_by_a_generation_times_out_and_never_commits(
    server: Server, source: TensorSource
) -> None:
    probe = Probe(server.url)
    engine = engine_for(server.url, source)
    running = None
    try:
        want = source.perturb(301)
        engine.send_weights("g1")
        running = running_generation(server.url, AUTH)
        source.perturb(302)
        refused: WeightSyncError | None = None
        with elapsed() as t:
            try:
                engine.send_weights("g2")
            except WeightSyncError as exc:
                refused = exc
        assert running[0].is_alive(), (
            "the generation ended before the verdict: the case tests nothing"
        )
        generation = released(server.url, *running, AUTH)
        running = None
        assert generation.status_code == 200, generation.text
        assert refused is not None, "the finish committed while a generation held the model"
        observe(trainer=refused, trainer_s=t[0])
        # The generation is over and the lock free: the server must still serve exactly g1,
        # as it said, and must have said so within its op timeout.
        assert_weights(probe, want, "g1")
        assert probe.session()["state"] == "uninitialized"
        assert refused.status == 504 and "was not committed" in refused.message, refused
        # the finish rode on the update (update_finishes): its failure still names the finish
        assert refused.route == "finish_weight_update", refused
        assert "weight_version 'g1' are still served" in refused.message, refused
        assert t[0] < OP_TIMEOUT_S + GRACE_S, (
            f"finish answered after {t[0]:.1f} s, not its {OP_TIMEOUT_S} s"
        )
    finally:
        if running is not None:
            released(server.url, *running, AUTH)
        quiet_shutdown(engine)
    fresh_round(server.url, source, probe, 303, "after-finish-timeout")
    probe.close()
