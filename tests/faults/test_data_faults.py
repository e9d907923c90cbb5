"""Faults inside a round's data: a source whose iteration lies about its metadata, a receiver
or control plane that stalls, a worker that refuses a tensor mid-round.

The same shared server and checks as ``test_round_faults.py``: the failing side raised an
error naming the cause within its timeout, the server still serves its last committed
weights and ``weight_version`` (or, for a round applied in place, refuses to serve until a
complete round commits), and a fresh init + round afterwards lands exactly.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import pytest
import torch

from tests.faults.harness import (
    FAULT_TIMEOUTS,
    GRACE_S,
    Probe,
    TensorSource,
    assert_weights,
    client_for,
    committed,
    elapsed,
    engine_for,
    fresh_round,
    hook_at,
    observe,
    quiet_shutdown,
    wait_idle,
)
from tests.faults.servers import Server
from weightwire.shared.errors import SourceMismatch, TransferTimeout, WeightSyncError

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------- lying sources
def _extra(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [*pairs, ("model.layers.9.extra.weight", torch.zeros(4))]


def _missing(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return pairs[:-1]


def _reordered(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [*pairs[:3], pairs[4], pairs[3], *pairs[5:]]


def _redtyped(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    name, tensor = pairs[5]
    return [*pairs[:5], (name, tensor.to(torch.bfloat16)), *pairs[6:]]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_extra, r"more tensors than metadata declared .*'model\.layers\.9\.extra\.weight'"),
        (
            _missing,
            r"yielded 38 tensors but metadata declared 39; first missing is 'model\.norm\.weight'",
        ),
        (_reordered, r"disagree at index 3: declared '.*' float32 .* got '.*'"),
        (_redtyped, r"disagree at index 5: declared '(.*)' float32 \[.*\], got '\1' bfloat16"),
    ],
    ids=["extra", "missing", "reordered", "redtyped"],
)
def test_source_metadata_and_iteration_disagree(
    shared_server: Server, probe: Probe, source: TensorSource, mutate: Any, message: str
) -> None:
    """Caught on the trainer before the bad tensor is sent; the worker is released at once by
    the aborted connection (well before its own 3 s receive timeout) and loads nothing."""
    engine = engine_for(shared_server.url, source)
    try:
        want = source.perturb(14)
        engine.send_weights("m1")
        source.mutate = mutate
        source.perturb(15)
        with elapsed() as t, pytest.raises(SourceMismatch, match=message) as info:
            engine.send_weights("m2")
        assert t[0] < GRACE_S
        waited = wait_idle(probe, FAULT_TIMEOUTS.transfer_s + GRACE_S)
        observe(trainer=info.value, trainer_s=t[0], server=probe.session(), server_s=waited)
        assert waited < FAULT_TIMEOUTS.transfer_s
        assert_weights(probe, want, "m1")
    finally:
        source.mutate = None
        quiet_shutdown(engine)
    fresh_round(shared_server.url, source, probe, 16, "after-source-mismatch")


# ----------------------------------------------------------------------------- stalls
def test_receiver_stops_reading(shared_server: Server, probe: Probe, source: TensorSource) -> None:
    """SIGSTOP the server's process group mid-broadcast: the send buffers fill, the trainer's
    broadcast watchdog fires after transfer_s; once resumed, the worker finds the dead
    connection, fails the round and keeps its weights. (No pause around the round: the
    failed round's resume would wait out the HTTP timeout on the frozen server.)"""
    engine = engine_for(shared_server.url, source, pause_mode=None)
    stopped = threading.Event()

    def freeze() -> None:
        shared_server.signal_group(signal.SIGSTOP)
        stopped.set()

    try:
        want = source.perturb(17)
        engine.send_weights("n1")
        source.hook = hook_at(2, freeze)
        source.perturb(18)
        try:
            with (
                elapsed() as t,
                pytest.raises(
                    TransferTimeout,
                    match=r"did not reach every receiver within 3 s; "
                    r"still sending to: rank 1 .*\(receiver stalled or too slow\)",
                ) as info,
            ):
                engine.send_weights("n2")
        finally:
            shared_server.signal_group(signal.SIGCONT)
        assert stopped.is_set() and t[0] < FAULT_TIMEOUTS.transfer_s + GRACE_S, t[0]
        # Not just "idle": right after SIGCONT the server may not even have read the update
        # POST yet (idle, round still open). The verdict is the failed round, whenever it lands.
        state, waited = probe.wait_session(
            lambda s: s["busy"] is None and s["state"] != "round_active",
            timeout=FAULT_TIMEOUTS.transfer_s + 30,
        )
        observe(
            trainer=info.value,
            trainer_s=t[0],
            server=state["last_error"],
            server_s_after_resume=waited,
        )
        # Who ends the round depends on where the freeze caught the server: the worker (its
        # sender is gone) or, when the update POST was not yet read, the round lease (the
        # frozen seconds count). Either way the round is aborted and n1 stays served.
        assert state["state"] == "uninitialized", state
        assert (
            "round failed" in state["last_error"] or "round lease expired" in state["last_error"]
        ), state
        assert_weights(probe, want, "n1")
    finally:
        source.hook = None
        quiet_shutdown(engine)
    fresh_round(shared_server.url, source, probe, 19, "after-stall")


def test_control_plane_stalls(shared_server: Server, probe: Probe, source: TensorSource) -> None:
    """SIGSTOP the server between rounds: the next HTTP call times out after the client's
    timeout and says which route; the weights stay; a fresh init recovers."""
    # No pause: a timed-out /pause would be read after SIGCONT and leave generation paused.
    engine = engine_for(
        shared_server.url,
        source,
        client=client_for(shared_server.url, timeout=3.0),
        pause_mode=None,
    )
    try:
        want = source.perturb(20)
        engine.send_weights("h1")
        shared_server.signal_group(signal.SIGSTOP)
        try:
            with (
                elapsed() as t,
                pytest.raises(
                    WeightSyncError, match=r"start_weight_update failed .*no answer within 3"
                ) as info,
            ):
                engine.send_weights("h2")
        finally:
            shared_server.signal_group(signal.SIGCONT)
        assert t[0] < 3.0 + GRACE_S
        observe(trainer=info.value, trainer_s=t[0], server=probe.session())
        assert_weights(probe, want, "h1")
        # The timed-out start may still be read and run now (it opens a round) or be refused;
        # shutdown waits out either (the round lease aborts such a round), after which a
        # stale start can only be refused, so the fresh init below cannot collide with it.
        engine.shutdown()
        assert probe.session()["state"] == "uninitialized"
    finally:
        quiet_shutdown(engine)
    fresh_round(shared_server.url, source, probe, 21, "after-http-stall")


# ---------------------------------------------------------------------- worker refuses mid-round
@pytest.mark.parametrize("strategy", ["staged", "streaming"], ids=["staged", "streaming"])
def test_worker_refuses_a_tensor_mid_round(
    shared_server: Server, probe: Probe, source: TensorSource, strategy: str
) -> None:
    """The worker refuses a tensor in the middle of a round (a name the model lacks), where the
    trainer could not check the round first (a client that does not tell the served model, as
    under stock vLLM's routes; the reference server's is refused before any byte:
    ``tests/server/test_server_coverage.py``). Staged:
    nothing was applied, the previous weights stay served. Applied in place: the earlier
    chunks are in the model, so the server stays paused (the trainer does not resume) and
    answers 503 naming the incomplete round, until a complete round commits."""
    budget = {"staged": 1 << 30, "streaming": 0}[strategy]
    want, version = committed(probe)
    source.perturb(22)  # new values: what lands in place differs from what is served
    original = dict(source.tensors)
    names = list(original)
    bogus = names[len(names) // 2]
    source.tensors = {
        ("model.layers.99.bogus.weight" if n == bogus else n): t for n, t in original.items()
    }
    client = client_for(shared_server.url, tells_served=False)
    engine = engine_for(shared_server.url, source, client=client, stage_budget_bytes=budget)
    try:
        with (
            elapsed() as t,
            pytest.raises(
                WeightSyncError, match="unknown weight name 'model.layers.99.bogus.weight'"
            ) as info,
        ):
            engine.send_weights("bogus")
    finally:
        quiet_shutdown(engine)
        source.tensors = original
    assert t[0] < FAULT_TIMEOUTS.transfer_s + GRACE_S, t[0]
    weight_info = probe.http.get("/weight_info").json()
    observe(trainer=info.value, trainer_s=t[0], weight_info=weight_info["incomplete_reason"])
    assert weight_info["weight_version"] == version
    if strategy == "staged":
        assert_weights(probe, want, version)
        assert not weight_info["round_incomplete"]
        probe.greedy()
    else:
        assert (
            weight_info["round_incomplete"]
            and "incomplete weight round" in weight_info["incomplete_reason"]
        )
        assert probe.checksums()[0] != want  # part of the round is in the model
        refused = probe.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert refused.status_code == 503, refused.text  # still paused: the trainer did not resume
    fresh_round(
        shared_server.url, source, probe, 23, f"after-refused-{strategy}", stage_budget_bytes=budget
    )
    assert not probe.http.get("/weight_info").json()["round_incomplete"]
    probe.greedy()
