"""Faults the server survives: refused init, out-of-order routes, a second trainer,
shutdown mid-round. (Faults inside a round's data, stalls included: ``test_data_faults.py``.)

One shared server (``--replicas 1``, ``--api-key``) for the whole module. Every case
checks, in this order: the failing side raised an error naming the cause within its
timeout; the other side failed (or refused) too; the server still serves its last
committed weights (per-tensor sha256 from ``/weight_checker``) and ``weight_version``;
and a fresh init + round afterwards lands exactly.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

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
    wait_busy,
    wait_idle,
)
from tests.faults.servers import Server, listening_sockets
from tests.trainer.overlap_helpers import slot_waiter
from weightwire.shared.errors import TransferError, WeightSyncError
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer import overlap
from weightwire.trainer.engine import EngineBroken
from weightwire.trainer.overlap import RoundWaitTimeout
from weightwire.trainer.snapshot import RoundCancelled

pytestmark = pytest.mark.timeout(120)
SLOW_RECEIVE = Timeouts(http_s=20.0, connect_s=8.0, warmup_s=8.0, transfer_s=15.0)
"""For cases that pause the trainer mid-round on purpose: the worker must not time out first."""


# ----------------------------------------------------------------------------- init
def test_server_refuses_init(shared_server: Server, probe: Probe, source: TensorSource) -> None:
    """A wrong API key: the init POST is refused (401) and the trainer fails at once, not
    after its 8 s rendezvous timeout, with its listening socket closed."""
    weights, version = committed(probe)
    listening = listening_sockets()
    with (
        elapsed() as t,
        pytest.raises(
            WeightSyncError, match=r"init_weight_transfer_engine failed .*status 401.*API key"
        ) as info,
    ):
        engine_for(
            shared_server.url,
            source,
            client=client_for(shared_server.url, api_key="wrong"),
            inference_world_size=1,
        )
    observe(trainer=info.value, trainer_s=t[0])
    assert t[0] < GRACE_S
    deadline = time.monotonic() + 30  # a hang detector: the listener closes within milliseconds
    while listening_sockets() != listening and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listening_sockets() == listening, "the refused trainer left its rendezvous port open"
    assert committed(probe) == (weights, version)
    assert probe.session()["state"] == "uninitialized"
    fresh_round(shared_server.url, source, probe, 1, "after-refused-init")


# ----------------------------------------------------------------------------- route order
def test_update_posted_without_start(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    engine = engine_for(shared_server.url, source)
    try:
        want = source.perturb(2)
        engine.send_weights("u1")
        meta = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[512]]}
        with elapsed() as t:
            resp = probe.http.post("/update_weights", json={"update_info": meta})
        observe(server=f"{resp.status_code} {resp.json()['error']['message']}", server_s=t[0])
        assert resp.status_code == 409 and t[0] < GRACE_S, resp.text
        assert (
            "no weight update is active: POST /start_weight_update"
            in resp.json()["error"]["message"]
        )
        assert probe.session()["state"] == "ready"  # refused before the session was touched
        assert_weights(probe, want, "u1")
        want = source.perturb(3)
        engine.send_weights("u2")  # the same engine carries on: no re-init needed
        assert_weights(probe, want, "u2")
    finally:
        engine.shutdown()


def test_finish_without_update(shared_server: Server, probe: Probe, source: TensorSource) -> None:
    engine = engine_for(
        shared_server.url, source, timeouts=SLOW_RECEIVE
    )  # the lease outlives the probe's calls
    try:
        want = source.perturb(4)
        engine.send_weights("f1")
        assert probe.http.post("/start_weight_update").status_code == 200
        with elapsed() as t:
            resp = probe.http.post(
                "/finish_weight_update", json={"weight_version": "f2-never-sent"}
            )
        observe(server=f"{resp.status_code} {resp.text}", server_s=t[0])
        assert t[0] < GRACE_S and resp.status_code < 500, resp.text
        assert probe.checksums()[0] == want  # no byte of a new round was ever loaded
        version_after = probe.version()
    finally:
        quiet_shutdown(engine)
    fresh_round(shared_server.url, source, probe, 5, "after-finish-without-update")
    assert resp.status_code == 409 and version_after == "f1", (
        f"finish_weight_update without any update_weights was accepted ({resp.status_code}) and "
        f"set weight_version to {version_after!r} although no weight arrived"
    )


# ----------------------------------------------------------------------------- two trainers
def test_second_trainer_init_while_a_round_is_in_flight(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """B's init during A's update is refused (409) at once; A's round completes untouched."""
    url = shared_server.url
    a = engine_for(url, source, timeouts=SLOW_RECEIVE)
    refused: list[BaseException] = []
    seconds: list[float] = []

    def second_trainer() -> None:
        wait_busy(probe, "update_weights")
        with elapsed() as t:
            try:
                quiet_shutdown(engine_for(url, TensorSource(source.tensors)))
            except WeightSyncError as exc:
                refused.append(exc)
        seconds.append(t[0])

    try:
        source.hook = hook_at(3, second_trainer)
        want = source.perturb(6)
        a.send_weights("a1")
    finally:
        source.hook = None
        quiet_shutdown(a)
    assert refused and seconds[0] < GRACE_S, "the second trainer's init was not refused"
    observe(second_trainer=refused[0], second_trainer_s=seconds[0])
    assert (
        refused[0].status == 409
        and "another weight operation (update_weights)" in refused[0].message
    )
    assert_weights(probe, want, "a1")
    fresh_round(url, source, probe, 7, "after-second-trainer")


def test_second_trainer_takes_over_an_idle_session(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """Between rounds the last init wins (vLLM's semantics), and the session has an owner:
    A's next round fails fast before any byte is sent (A sees its link closed, or the
    server refuses A's start with 409 naming the takeover: whichever A notices first), A's
    shutdown cannot end B's session (it is not posted, and a stale one is refused 409), and
    B carries on without re-init; A's weights stay served until B commits."""
    from weightwire.shared.routes import SESSION_HEADER

    url = shared_server.url
    a_client = client_for(url)
    a = engine_for(url, source, client=a_client)
    b = None
    try:
        want = source.perturb(8)
        a.send_weights("a1")
        a_session = a_client._sessions[0]
        assert a_session is not None, "the server's init reply carried no session_id"
        b_source = TensorSource(source.tensors)
        b = engine_for(url, b_source)  # accepted: A's session was idle
        source.perturb(9)
        with elapsed() as t, pytest.raises((WeightSyncError, EngineBroken)) as info:
            a.send_weights("a2")
        observe(first_trainer=info.value, first_trainer_s=t[0], server=probe.session())
        assert t[0] < GRACE_S, f"A's stale round took {t[0]:.1f} s to fail"
        if isinstance(info.value, WeightSyncError):
            assert (
                info.value.status == 409
                and "was replaced by a newer /init_weight_transfer_engine" in info.value.message
            )
        else:
            assert "took the session over" in str(info.value)
        assert_weights(probe, want, "a1")
        assert probe.session()["state"] == "ready", "A's failed round disturbed B's session"
        quiet_shutdown(a)
        stale = probe.http.post(
            "/shutdown_weight_transfer_engine", headers={SESSION_HEADER: a_session}
        )
        observe(stale_shutdown=f"{stale.status_code} {stale.json()['error']['message']}")
        assert stale.status_code == 409 and "replaced by a newer" in stale.text, stale.text
        assert probe.session()["state"] == "ready", "A's shutdown killed B's session"
        want = b_source.perturb(10)
        b.send_weights("b1")  # B's session is intact: no re-init
        assert_weights(probe, want, "b1")
    finally:
        quiet_shutdown(a)
        if b is not None:
            quiet_shutdown(b)
    fresh_round(url, source, probe, 10, "after-takeover")


def test_round_lease_aborts_a_round_whose_trainer_went_quiet(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """A round started and then abandoned (the trainer vanished after start): the server
    aborts it by itself once the lease (the trainer's transfer_s) runs out; no manual
    finish; the committed weights and version stay served."""
    engine = engine_for(shared_server.url, source)
    try:
        want = source.perturb(30)
        engine.send_weights("l1")
        assert (
            probe.http.post("/start_weight_update").status_code == 200
        )  # ... and nobody follows up
        state, waited = probe.wait_session(
            lambda s: s["state"] != "round_active", timeout=FAULT_TIMEOUTS.transfer_s + 30
        )
        observe(server=state["last_error"], server_s=waited)
        assert state["state"] == "uninitialized" and state["busy"] is None, state
        assert (
            "round lease expired" in state["last_error"]
            and "'l1' is still served" in state["last_error"]
        ), state
        assert_weights(probe, want, "l1")
    finally:
        quiet_shutdown(engine)
    fresh_round(shared_server.url, source, probe, 31, "after-lease")


class _TrainerBug(Exception):
    pass


def _source_fails() -> None:
    raise _TrainerBug("the source failed mid-round")


def test_shutdown_right_after_a_failed_round_keeps_the_round_error(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``try: send_weights() finally: shutdown()`` after a trainer-side failure mid-round,
    while the server has not yet failed the round (its worker is frozen until the first
    shutdown attempt was answered 409 "a weight update is active"): the caller sees its
    own error, the shutdown waits for the server's verdict and then really happens, and
    the caller's next cleanup step still runs."""
    url = shared_server.url
    worker = shared_server.worker_pids()[0]
    client = client_for(url)
    real_shutdown = client.shutdown_weight_transfer_engine
    answers: list[str] = []

    def shutdown_then_unfreeze() -> None:
        try:
            real_shutdown()
            answers.append("ok")
        except WeightSyncError as exc:
            answers.append(f"{exc.status} {exc.message}")
            os.kill(worker, signal.SIGCONT)  # the server can now fail the round
            raise

    client.shutdown_weight_transfer_engine = shutdown_then_unfreeze  # type: ignore[method-assign]
    engine = engine_for(url, source, client=client)
    closed: list[bool] = []

    def bug() -> None:
        wait_busy(probe, "update_weights")  # the server is receiving: the failure is mid-round
        os.kill(worker, signal.SIGSTOP)
        raise _TrainerBug("the trainer's own bug, mid-round")

    try:
        want = source.perturb(32)
        engine.send_weights("x1")
        source.hook = hook_at(3, bug)
        source.perturb(33)
        with pytest.raises(_TrainerBug):
            try:
                engine.send_weights("x2")
            finally:
                engine.shutdown()
                closed.append(True)  # the caller's next cleanup step (client.close()) still runs
    finally:
        os.kill(worker, signal.SIGCONT)
        source.hook = None
        quiet_shutdown(engine)
    observe(shutdown_answers=answers)
    assert closed == [True]
    assert answers[0].startswith("409") and "a weight update is active" in answers[0], answers
    assert answers[-1] == "ok", answers
    state = probe.session()
    assert state["state"] == "uninitialized" and state["busy"] is None, state
    assert_weights(probe, want, "x1")
    fresh_round(url, source, probe, 34, "after-shutdown-after-failure")


def test_a_trainer_gone_after_its_first_bytes_with_its_update_lost_is_dropped_at_once(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """The round's first chunks went out, its update POST never reached the workers (lost;
    or refused 409 because the trainer's own shutdown held the session), then the source
    failed: the bytes wait unread in the worker's socket. The trainer's shutdown finds the
    round stale at once (its data link closed), not after the round lease's 409s; the
    last committed weights stay served."""
    url = shared_server.url
    client = client_for(url)
    lost = threading.Event()

    def update_lost(*args: object, **kwargs: object) -> None:
        lost.wait(SLOW_RECEIVE.http_s)
        raise ConnectionError("the update POST was lost")

    engine = engine_for(url, source, client=client, timeouts=SLOW_RECEIVE)
    try:
        want = source.perturb(35)
        engine.send_weights("g1")
        client.update_weights = update_lost  # type: ignore[method-assign]
        client.update_and_finish = update_lost  # type: ignore[method-assign]
        source.hook = hook_at(3, _source_fails)
        source.perturb(36)
        with elapsed() as t, pytest.raises(_TrainerBug):
            try:
                engine.send_weights("g2")
            finally:
                engine.shutdown()
        observe(trainer_s=t[0], server=probe.session()["last_error"])
        assert t[0] < GRACE_S, f"shutdown waited {t[0]:.1f} s: the round was not seen stale"
    finally:
        lost.set()
        source.hook = None
        quiet_shutdown(engine)
    state = probe.session()
    assert state["state"] == "uninitialized" and state["busy"] is None, state
    assert "closed the data link" in str(state["last_error"]), state
    assert_weights(probe, want, "g1")
    fresh_round(url, source, probe, 37, "after-lost-update")


def test_a_trainer_failing_mid_round_raises_once_its_servers_ended_the_round(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """The trainer's own failure mid-round while its update POST is still on its way (a
    loaded host): ``send_weights`` raises only once that POST answered, so the server has
    failed the round on the closed link by then, and the caller's next call (a shutdown,
    which a stock vLLM refuses with a 500 while its worker's update is active) meets no
    round; the last committed weights stay served."""
    url = shared_server.url
    client = client_for(url)
    engine = engine_for(url, source, client=client)
    try:
        want = source.perturb(38)
        engine.send_weights("v1")
        for name in ("update_weights", "update_and_finish"):
            slow = getattr(client, name)

            def late(*args: object, _post: Any = slow, **kwargs: object) -> Any:
                time.sleep(0.5)  # the trainer's own failure comes first
                return _post(*args, **kwargs)

            setattr(client, name, late)
        source.hook = hook_at(3, _source_fails)
        source.perturb(39)
        with elapsed() as t, pytest.raises(_TrainerBug):
            engine.send_weights("v2")
        state = probe.session()
        observe(trainer_s=t[0], server=state["last_error"])
        assert state["state"] != "round_active" and state["busy"] is None, state
        assert t[0] < GRACE_S
    finally:
        source.hook = None
        quiet_shutdown(engine)
    assert_weights(probe, want, "v1")
    fresh_round(url, source, probe, 40, "after-late-update")


# ----------------------------------------------------------------------------- shutdown
def test_shutdown_during_a_round(shared_server: Server, probe: Probe, source: TensorSource) -> None:
    """Shutdown is refused while a round is open or receiving; the round then completes.
    A trainer that closes its own engine from another thread mid-round stops that round: its
    ``send_weights`` fails fast with ``EngineBroken`` naming the shutdown, shutdown returns
    once it ended, and the server keeps its weights."""
    url = shared_server.url
    engine = engine_for(url, source, timeouts=SLOW_RECEIVE)
    answers: list[httpx.Response] = []
    try:
        source.hook = hook_at(
            3,
            lambda: (
                wait_busy(probe, "update_weights"),
                answers.append(probe.http.post("/shutdown_weight_transfer_engine")),
            ),
        )
        want = source.perturb(11)
        engine.send_weights("s1")
        refused = answers[0]
        observe(
            shutdown_during_update=f"{refused.status_code} {refused.json()['error']['message']}"
        )
        assert answers[0].status_code == 409 and "a weight update is active" in answers[0].text, (
            answers[0].text
        )
        assert_weights(probe, want, "s1")
        assert probe.http.post("/start_weight_update").status_code == 200
        resp = probe.http.post("/shutdown_weight_transfer_engine")
        assert resp.status_code == 409 and "a weight update is active" in resp.text, resp.text
    finally:
        source.hook = None
        quiet_shutdown(engine)

    engine = engine_for(url, source)  # a fresh init replaces the dangling round
    closer: list[threading.Thread] = []
    try:
        engine.send_weights("s2")
        want = source.expected()

        def close_from_another_thread() -> None:
            closer.append(threading.Thread(target=quiet_shutdown, args=(engine,)))
            closer[0].start()

        source.hook = hook_at(4, close_from_another_thread)
        source.perturb(12)
        with (
            elapsed() as t,
            pytest.raises(
                EngineBroken, match=r"send_weights was stopped: shutdown\(\) was called"
            ) as info,
        ):
            engine.send_weights("s3")
        observe(trainer=info.value, trainer_s=t[0])
        assert t[0] < GRACE_S
        assert isinstance(info.value.__cause__, (TransferError, WeightSyncError))
        assert "uncommitted" in str(info.value) and "trainer_init()" in str(info.value)
        closer[0].join(GRACE_S)  # shutdown waited for the stopped round, and no longer
        assert not closer[0].is_alive(), "engine.shutdown() hung while a round was in flight"
        with pytest.raises(EngineBroken, match="was shut down, so it sends nothing more"):
            engine.send_weights("s4")
        waited = wait_idle(probe, FAULT_TIMEOUTS.transfer_s + GRACE_S)
        observe(server=probe.session()["last_error"], server_s=waited)
        assert_weights(probe, want, "s2")
    finally:
        source.hook = None
        quiet_shutdown(engine)
    fresh_round(url, source, probe, 13, "after-shutdown-mid-round")


def test_a_round_failing_on_its_own_keeps_its_error_when_another_thread_shuts_down(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """The trainer's own failure mid-round, then (while the round still waits for its update
    POST's answer) ``shutdown()`` from another thread: ``send_weights`` raises the round's
    own error, the shutdown only a note on it (was: ``EngineBroken`` naming the shutdown,
    the real error only its ``__cause__``); shutdown returns once that call ended and the
    last committed weights stay served."""
    url = shared_server.url
    client = client_for(url)
    engine = engine_for(url, source, client=client)
    closer: list[threading.Thread] = []
    try:
        want = source.perturb(41)
        engine.send_weights("o1")
        for name in ("update_weights", "update_and_finish"):
            post = getattr(client, name)

            def answered_then_shut(*args: object, _post: Any = post, **kwargs: object) -> Any:
                try:
                    return _post(*args, **kwargs)  # fails: the bug closed the data link
                finally:  # the round's error came first; the shutdown begins before it raises
                    closer.append(threading.Thread(target=quiet_shutdown, args=(engine,)))
                    closer[0].start()
                    deadline = time.monotonic() + FAULT_TIMEOUTS.http_s
                    while not engine._closed and time.monotonic() < deadline:
                        time.sleep(0.01)

            setattr(client, name, answered_then_shut)
        source.hook = hook_at(3, _source_fails)
        source.perturb(42)
        with (
            elapsed() as t,
            pytest.raises(_TrainerBug, match="the source failed mid-round") as info,
        ):
            engine.send_weights("o2")
        observe(trainer=info.value, notes=getattr(info.value, "__notes__", []), trainer_s=t[0])
        assert t[0] < GRACE_S
        assert closer, "the update POST never went out: the case tested nothing"
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "shutdown() was called (from another thread)" in notes, notes
        closer[0].join(GRACE_S)
        assert not closer[0].is_alive(), "engine.shutdown() hung after the failed round"
        with pytest.raises(EngineBroken, match="was shut down, so it sends nothing more"):
            engine.send_weights("o3")
    finally:
        source.hook = None
        quiet_shutdown(engine)
    wait_idle(probe, FAULT_TIMEOUTS.transfer_s + GRACE_S)
    assert_weights(probe, want, "o1")
    fresh_round(url, source, probe, 43, "after-failed-round-and-shutdown")


# ----------------------------------------------------------------------------- overlapped rounds
def test_an_overlapped_failure_is_raised_by_the_call_waiting_for_its_slot(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """#46 (4): with one slot, round w2 fails (a trainer bug before its first chunk) while
    ``send_weights("w3", wait=False)`` waits for the slot w2 frees: that call raises w2's own
    error, w3 never reaches the server, and the engine goes on."""
    url = shared_server.url
    engine = engine_for(url, source, snapshot="none")  # the round thread reads the source
    entered, release = threading.Event(), threading.Event()
    outcome: list[object] = []

    def bug() -> None:
        entered.set()
        assert release.wait(FAULT_TIMEOUTS.http_s)
        raise _TrainerBug("the trainer's own bug, before the round's first chunk")

    def next_round() -> None:
        try:
            outcome.append(engine.send_weights("w3", wait=False))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=next_round)
    try:
        want = source.perturb(35)
        assert engine.send_weights("w1", wait=False).result().version == "w1"
        committed_before = probe.session()["rounds_committed"]
        source.hook = hook_at(0, bug)
        source.perturb(36)
        failing = engine.send_weights("w2", wait=False)
        assert entered.wait(FAULT_TIMEOUTS.http_s)  # w2 holds the only slot
        waiting = slot_waiter(engine)
        thread.start()
        assert waiting.wait(FAULT_TIMEOUTS.http_s)  # w3's call waits for the slot ...
        release.set()  # ... and w2 fails now
        thread.join(FAULT_TIMEOUTS.http_s)
        assert not thread.is_alive()
        (raised,) = outcome
        told = f"{raised} {getattr(raised, '__notes__', '')}"
        observe(trainer=told)
        assert isinstance(raised, _TrainerBug), told
        assert "round 'w2' (overlapped round #2) failed in flight; no round after it was sent" in (
            told
        )
        with pytest.raises(_TrainerBug) as again:
            failing.result(timeout=0)
        assert again.value is raised  # the round's own error, the same object
        state = probe.session()
        assert state["rounds_committed"] == committed_before and state["state"] == "ready", state
        assert_weights(probe, want, "w1")  # w3 was never sent
        source.hook = None
        want = source.perturb(37)
        assert engine.send_weights("w4").version == "w4"  # raised once: the engine goes on
        assert_weights(probe, want, "w4")
    finally:
        release.set()
        source.hook = None
        if thread.is_alive():
            thread.join(FAULT_TIMEOUTS.http_s)
        quiet_shutdown(engine)


def test_a_shutdown_that_runs_out_leaves_no_round_that_can_commit(
    shared_server: Server, probe: Probe, source: TensorSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#46 (11): the server holds all of round t2 and waits for its finish while the trainer
    stalls; ``shutdown(timeout=0.5)`` runs out: the round is stopped before its commit, the
    server drops it at once (its data link closed) and shuts the session down (not left
    ready), the error says both, and when the stall ends the round commits nothing."""
    monkeypatch.setattr(overlap, "_ABORT_WAIT_S", 0.5)  # the round is still stalled after it
    url = shared_server.url
    client = client_for(url)
    real_update = client.update_weights
    stall, replied, release = threading.Event(), threading.Event(), threading.Event()

    def update_then_stall(update_info: object) -> None:
        real_update(update_info)  # the server received the whole round
        if stall.is_set():
            replied.set()
            release.wait(FAULT_TIMEOUTS.http_s)  # the trainer stalls before its finish

    client.update_weights = update_then_stall  # type: ignore[method-assign]
    engine = engine_for(url, source, client=client)
    try:
        want = source.perturb(38)
        engine.send_weights("t1")
        stall.set()
        source.perturb(39)
        handle = engine.send_weights("t2", wait=False)
        assert replied.wait(FAULT_TIMEOUTS.http_s)
        with elapsed() as t, pytest.raises(RoundWaitTimeout) as info:
            engine.shutdown(timeout=0.5)
        told = f"{info.value} {getattr(info.value, '__notes__', '')}"
        state = probe.session()
        observe(trainer=told, trainer_s=t[0], server=state)
        assert "round 't2' (overlapped round #1) is still in flight after 0.5 s" in told, told
        assert "stopped before its commit (no finish sent)" in told, told
        assert "shut this trainer's weight-transfer session down" in told, told
        assert state["state"] == "uninitialized" and state["busy"] is None, state
        assert "round dropped by its trainer's shutdown" in state["last_error"], state
        assert t[0] < 1.0 + GRACE_S, t[0]  # not the round lease (transfer_s): dropped at once
        release.set()  # the stall ends: the round must not commit now
        with pytest.raises(RoundCancelled, match="its finish was never sent"):
            handle.result(timeout=FAULT_TIMEOUTS.http_s)
        assert_weights(probe, want, "t1")
        assert probe.session()["state"] == "uninitialized"
    finally:
        release.set()
        quiet_shutdown(engine)
    fresh_round(url, source, probe, 40, "after-shutdown-timeout")
