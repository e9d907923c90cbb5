"""Processes that die: the trainer, the whole server (before and during a broadcast), and
one receiver replica of two while the other lives.

One ``--replicas 2`` server at a time for the module; a case that kills it starts the
next one (which is also the "fresh init + round afterwards" of that case). Every case
checks that each side raised, or recorded, an error naming the cause within its
timeout, what the surviving receivers serve, and that a fresh init + round lands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import (
    FAULT_TIMEOUTS,
    GRACE_S,
    Probe,
    TensorSource,
    assert_weights,
    client_for,
    elapsed,
    engine_for,
    fresh_round,
    hook_at,
    load_weights,
    observe,
    quiet_shutdown,
    sha256_of,
)
from tests.faults.servers import Server, launch
from weightwire.shared.errors import TransferError, WeightSyncError
from weightwire.trainer import EngineBroken, RoundSkipped

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]


class Servers:
    """The module's current server; ``replace()`` kills it and starts the next."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs, self.n = model, logs, 0
        self.current: Server = self._start()
        self.probe = Probe(self.current.url)

    def _start(self) -> Server:
        self.n += 1
        return launch(self.model, self.logs / f"server-{self.n}.log", "--replicas", "2")

    def replace(self) -> Server:
        self.current.stop()
        self.probe.close()
        self.current = self._start()
        self.probe = Probe(self.current.url)
        return self.current

    def close(self) -> None:
        self.probe.close()
        self.current.stop()


@pytest.fixture(scope="module")
def servers(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(fault_model, tmp_path_factory.mktemp("process-faults"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def checkpoint(fault_model: Path) -> dict[str, str]:
    """What a freshly started server must serve: the checkpoint's own bytes."""
    return {n: sha256_of(t) for n, t in load_weights(fault_model).items()}


def wait_busy(probe: Probe) -> None:
    """Block the trainer's iteration until the server is inside update_weights (receiving)."""
    probe.wait_session(lambda s: s["busy"] == "update_weights", timeout=10)


def wait_idle(probe: Probe, timeout: float) -> tuple[dict, float]:
    return probe.wait_session(lambda s: s["busy"] is None, timeout)


# ----------------------------------------------------------------------------- refused init
def test_server_refuses_a_stale_world_size(servers: Servers, source: TensorSource) -> None:
    """A trainer that believes the server has 1 worker (it has 2): the init is refused with
    422 naming world_size, at once; the rendezvous is cancelled; nothing changed."""
    probe = servers.probe
    before = probe.checksums()
    with (
        elapsed() as t,
        pytest.raises(
            WeightSyncError, match=r"status 422.*world_size 2 is too small.*2 worker"
        ) as info,
    ):
        engine_for(servers.current.url, source, inference_world_size=1)
    observe(trainer=info.value, trainer_s=t[0])
    assert t[0] < GRACE_S
    assert probe.checksums() == before and probe.version() == "default"
    fresh_round(servers.current.url, source, probe, 201, "after-stale-world-size")


# ----------------------------------------------------------------------------- trainer dies
@pytest.mark.parametrize("strategy", ["staged", "streaming"], ids=["staged", "streaming"])
def test_trainer_dies_mid_broadcast(
    servers: Servers, fault_model: Path, source: TensorSource, strategy: str
) -> None:
    probe = servers.probe
    budget = {"staged": 1 << 30, "streaming": 0}[strategy]
    cfg = json.dumps(
        {
            "url": servers.current.url,
            "model_dir": str(fault_model),
            "kill_at": 5,
            "stage_budget_bytes": budget,
        }
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.faults._trainer_proc", cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, f"rc={proc.returncode}\n{out}\n{err[-3000:]}"
    committed = json.loads(out.splitlines()[0])["committed"]
    # The worker sees the dead connection at once, not after its 3 s receive timeout.
    state, waited = wait_idle(probe, FAULT_TIMEOUTS.transfer_s + GRACE_S)
    observe(server=state["last_error"], server_s_after_exit=waited)
    assert waited < FAULT_TIMEOUTS.transfer_s, waited
    assert state["state"] == "uninitialized" and state["rounds_failed"] >= 1, state
    assert (
        "lost rank 0" in state["last_error"] and "connection closed by peer" in state["last_error"]
    ), state
    if strategy == "staged":
        assert_weights(probe, committed, "t1")
        assert not probe.http.get("/weight_info").json()["round_incomplete"]
        fresh_round(servers.current.url, source, probe, 202, "after-trainer-death")
        return
    # Applied in place: the dead trainer left the server paused (abort: refusing) and its
    # models incomplete. Refused with a reason even after an operator's plain /resume.
    info = probe.http.get("/weight_info").json()
    assert info["round_incomplete"] and "incomplete weight round" in info["incomplete_reason"], info
    assert info["weight_version"] == "t1"
    refused = probe.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert refused.status_code == 503 and "paused" in refused.text, refused.text
    assert probe.http.post("/resume").status_code == 200
    refused = probe.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    observe(completion_after_resume=refused.json())
    assert refused.status_code == 503 and "incomplete weight round" in refused.text, refused.text
    # A fresh trainer's complete round (in place too: it pauses, commits, resumes) makes it whole.
    fresh_round(
        servers.current.url, source, probe, 202, "after-trainer-death", stage_budget_bytes=0
    )
    assert not probe.http.get("/weight_info").json()["round_incomplete"]
    probe.greedy()


# ----------------------------------------------------------------------------- server dies
@pytest.mark.slow  # 21 s on 2 cores; test_server_dies_mid_broadcast stays in the README lane
def test_server_dies_before_broadcast(
    servers: Servers, source: TensorSource, checkpoint: dict[str, str]
) -> None:
    engine = engine_for(servers.current.url, source)
    try:
        source.perturb(203)
        engine.send_weights("b1")
        servers.current.kill()
        with (
            elapsed() as t,
            pytest.raises(
                (WeightSyncError, EngineBroken),
                # the dead server's data link may be seen closed before the round's first call
                match=r"(?:pause|start_weight_update) failed .*no response.*Connect"
                r"|a server closed this trainer's data link.*nothing was sent",
            ) as info,
        ):
            engine.send_weights("b2")
        observe(trainer=info.value, trainer_s=t[0])
        assert t[0] < GRACE_S
        with elapsed() as t:  # returns or says why, never hangs on the dead server
            try:
                engine.shutdown()
            except WeightSyncError as exc:
                assert "shutdown_weight_transfer_engine failed" in str(exc)
        assert t[0] < GRACE_S
    finally:
        quiet_shutdown(engine)
    servers.replace()
    assert_weights(servers.probe, checkpoint, "default")
    fresh_round(servers.current.url, source, servers.probe, 204, "after-server-death")


def test_server_dies_mid_broadcast(
    servers: Servers, source: TensorSource, checkpoint: dict[str, str]
) -> None:
    engine = engine_for(servers.current.url, source)
    try:
        source.perturb(205)
        engine.send_weights("d1")
        source.hook = hook_at(3, lambda: (wait_busy(servers.probe), servers.current.kill()))
        source.perturb(206)
        with elapsed() as t, pytest.raises((WeightSyncError, TransferError)) as info:
            engine.send_weights("d2")
        observe(trainer=f"{type(info.value).__name__}: {info.value}", trainer_s=t[0])
        assert t[0] < FAULT_TIMEOUTS.transfer_s + GRACE_S, t[0]
        assert any(
            w in str(info.value) for w in ("lost rank", "disconnected", "Connection", "connection")
        ), info.value
    finally:
        source.hook = None
        quiet_shutdown(engine)
    servers.replace()
    assert_weights(servers.probe, checkpoint, "default")
    fresh_round(servers.current.url, source, servers.probe, 207, "after-server-death-mid-round")


# ----------------------------------------------------------------------------- one replica dies
@pytest.mark.slow  # 23 s on 2 cores
def test_replica_dies_while_the_other_lives(servers: Servers, source: TensorSource) -> None:
    probe = servers.probe
    engine = engine_for(servers.current.url, source)
    try:
        want = source.perturb(208)
        engine.send_weights("r1")
        assert_weights(probe, want, "r1")
        served = probe.greedy()  # replica 0 answers (lowest index among idle replicas)
        victim = servers.current.worker_pids()[1]
        source.hook = hook_at(3, lambda: (wait_busy(probe), os.kill(victim, signal.SIGKILL)))
        source.perturb(209)
        with elapsed() as t, pytest.raises((WeightSyncError, TransferError)) as info:
            engine.send_weights("r2")
        assert t[0] < FAULT_TIMEOUTS.transfer_s + GRACE_S, t[0]
        # The trainer lost rank 2 (replica 1) first; the server's answer lists replica 1 as failed.
        told = f"{info.value} {getattr(info.value, '__notes__', '')}"
        observe(trainer=told, trainer_s=t[0])
        assert "lost rank 2" in told or "replica 1" in told, told
        assert "[1]" in told or "replica 1" in told, told
    finally:
        source.hook = None
        quiet_shutdown(engine)
    state, waited = wait_idle(probe, FAULT_TIMEOUTS.transfer_s + GRACE_S)
    observe(server=state["last_error"])
    assert state["state"] == "uninitialized" and "replica 1" in state["last_error"], state
    assert probe.version() == "r1"
    health = probe.http.get("/health")
    assert health.status_code == 503 and "replica 1" in health.text, health.text
    # The live replica aborted its half of the round: it still serves r1, token for token.
    assert probe.greedy() == served
    with (
        elapsed() as t,
        pytest.raises(WeightSyncError, match=r"status 503.*replica 1") as init_info,
    ):
        engine_for(servers.current.url, source)  # the dead replica is named, never a hang
    observe(init_after=init_info.value, init_after_s=t[0])
    assert t[0] < FAULT_TIMEOUTS.connect_s + GRACE_S
    init_seconds = t[0]
    servers.replace()  # the reference server does not respawn workers: restart it
    fresh_round(servers.current.url, source, servers.probe, 210, "after-replica-death")
    # Which error the trainer sees first (its own PeerLost or the server's answer) is a
    # race; the server's record naming replica 1 is asserted above. Init must not wait.
    assert init_seconds < GRACE_S, (
        f"an init while a replica is dead took {init_seconds:.1f} s instead of failing at once"
    )


def test_overlapped_round_fails_in_flight_and_no_later_round_lands(
    servers: Servers, source: TensorSource
) -> None:
    """An overlapped round (``send_weights(wait=False)``) loses a replica mid-broadcast while
    a later round waits behind it: the next ``send_weights`` raises the failed round's own
    error, the queued round is never sent (``RoundSkipped`` naming the failed one), and the
    server keeps the last committed round."""
    probe = servers.probe
    # snapshot="none": the rounds read the source on the round thread, so the hook fires
    # mid-round there (a copy snapshot would read it on the caller's thread instead).
    engine = engine_for(servers.current.url, source, max_rounds_in_flight=2, snapshot="none")
    try:
        want = source.perturb(211)
        assert engine.send_weights("o1", wait=False).result().version == "o1"
        assert_weights(probe, want, "o1")
        served = probe.greedy()  # replica 0 answers (lowest index among idle replicas)
        victim = servers.current.worker_pids()[1]
        source.hook = hook_at(3, lambda: (wait_busy(probe), os.kill(victim, signal.SIGKILL)))
        source.perturb(212)
        failing = engine.send_weights("o2", wait=False)
        queued = engine.send_weights("o3", wait=False)
        with elapsed() as t:
            deadline = time.monotonic() + FAULT_TIMEOUTS.transfer_s + 2 * GRACE_S
            while not failing.done() and time.monotonic() < deadline:
                time.sleep(0.05)  # no result(): the failure must reach the next send_weights
        assert failing.done() and queued.done(), "the failed round did not end in time"
        assert t[0] < FAULT_TIMEOUTS.transfer_s + GRACE_S, t[0]
        with pytest.raises((WeightSyncError, TransferError)) as info:
            engine.send_weights("o4", wait=False)
        told = f"{info.value} {getattr(info.value, '__notes__', '')}"
        observe(trainer=told, trainer_s=t[0])
        assert "lost rank 2" in told or "replica 1" in told, told
        assert "round 'o2' (overlapped round #2) failed in flight" in told, told
        with pytest.raises(type(info.value)) as again:
            failing.result(timeout=0)
        assert again.value is info.value  # the round's own error, the same object
        with pytest.raises(RoundSkipped, match=r"round 'o3' .* was not sent: round 'o2'"):
            queued.result(timeout=0)
        with pytest.raises(EngineBroken):  # the link was aborted mid-round: re-init first
            engine.send_weights("o5", wait=False)
    finally:
        source.hook = None
        quiet_shutdown(engine)
    wait_idle(probe, FAULT_TIMEOUTS.transfer_s + GRACE_S)
    assert probe.version() == "o1"  # neither o2 nor the queued o3 took effect
    assert probe.greedy() == served  # the live replica still serves o1, token for token
    servers.replace()  # the reference server does not respawn workers: restart it
    fresh_round(servers.current.url, source, servers.probe, 213, "after-overlapped-failure")


def test_client_names_the_route_when_no_server_listens(source: TensorSource) -> None:
    """The cheapest fault of all: nothing at the URL. The trainer fails at its first call."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with (
        elapsed() as t,
        pytest.raises(
            WeightSyncError, match=r"version failed on .* \(no response\): ConnectError"
        ) as info,
    ):
        engine_for(url, source, client=client_for(url))
    observe(trainer=info.value, trainer_s=t[0])
    assert t[0] < GRACE_S
