"""A trainer killed mid-send, its bytes unread on the workers' links: the reference server
(``weightwire serve``, ``weightwire_tcp``) with a round lease far longer than the trainer's
transfer bound, so only the workers' own look at their links can end the round early."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from _server_sender import Background, TCPSender, VLLMStyleClient, update_info_of

LEASE_S = 120.0  # --round-lease: the old bound on such a round
TRANSFER_S = 2.0  # the dying trainer's timeout_s (its transfer bound)


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama: str):
    return server_factory(["--model", tiny_llama, "--replicas", "1", "--round-lease", str(LEASE_S)])


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _checksums(http: httpx.Client) -> list[dict[str, str]]:
    return http.post("/weight_checker", json={"action": "checksum"}).json()["replica_checksums"]


def _stuffing_trainer(url: str) -> subprocess.Popen[str]:
    """A trainer process that inits, starts a round and broadcasts 16 MiB with no update
    posted (far more than the sockets' buffers hold), then waits to be killed."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_server_sender.py"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    assert proc.stdin is not None and proc.stdout is not None
    cfg = {
        "base_url": url,
        "replicas": 1,
        "buffer_size": 8192,
        "stuff_bytes": 16 << 20,
        "timeout_s": TRANSFER_S,
    }
    proc.stdin.write(json.dumps(cfg) + "\n")
    proc.stdin.flush()
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(60)
    assert line == ["stuffed\n"], line
    return proc


def test_a_trainer_killed_with_its_bytes_unread_ends_its_round_at_its_transfer_bound(
    server, http: httpx.Client, base_weights: dict[str, np.ndarray]
) -> None:
    """The trainer dies after its bytes filled the worker's receive window, before any
    update: Linux keeps the dead trainer's close (FIN) queued behind the unsent bytes, so
    the worker's ``POLLRDHUP`` never fires and the link looks connected. The server asks
    the workers at the trainer's transfer bound (``timeout_s`` + 0.5 s) and aborts the round,
    saying the trainer's bytes wait unread with no update (was: the round stayed open until
    ``--round-lease``, 120 s here, and a new trainer's init was refused meanwhile); the old
    weights stay served and a new trainer's round commits."""
    before = (http.get("/weight_info").json(), _checksums(http))
    failed = before[0]["session"]["rounds_failed"]
    proc = _stuffing_trainer(server.url)
    try:
        killed = time.monotonic()
        proc.kill()
        proc.wait(10)
        info = http.get("/weight_info").json()
        assert info["session"]["state"] == "round_active", info  # nothing told the server yet
        deadline = killed + 20  # well under the lease
        while (info := http.get("/weight_info").json())["session"]["rounds_failed"] == failed:
            assert time.monotonic() < deadline, f"the round is still open: {info}"
            time.sleep(0.1)
        took = time.monotonic() - killed
    finally:
        proc.kill()
        proc.wait(10)
    error = info["session"]["last_error"]
    assert "bytes wait unread on the data link with no update" in error, error
    assert f"past its transfer bound ({TRANSFER_S:g} s)" in error, error
    assert took < TRANSFER_S + 8, took
    assert info["weight_version"] == before[0]["weight_version"]
    assert _checksums(http) == before[1]
    sender = TCPSender(VLLMStyleClient(server.url), replicas=1)
    try:
        sender.init()
        sender.round(base_weights, "after-the-dead-trainer")
    finally:
        sender.close()
    assert http.get("/weight_info").json()["weight_version"] == "after-the-dead-trainer"


def test_an_update_posted_late_but_within_the_transfer_bound_still_commits(
    server, http: httpx.Client, base_weights: dict[str, np.ndarray]
) -> None:
    """A live trainer whose update POST reaches the server a second after its bytes (within
    its transfer bound, 2 s): the round is not taken for stale and commits."""
    sender = TCPSender(VLLMStyleClient(server.url), replicas=1)
    try:
        sender.init(timeout_s=TRANSFER_S)
        sender.client.start_weight_update()
        chunks = sender.chunks(base_weights)
        sending = Background(
            lambda: [sender.comm.broadcast(c, timeout=TRANSFER_S + 5) for c in chunks]
        )
        time.sleep(1.0)  # the bytes wait; the update comes late
        sender.client.update_weights(update_info_of(base_weights))
        sending.result()
        sender.client.finish_weight_update("late-update")
    finally:
        sender.close()
    assert http.get("/weight_info").json()["weight_version"] == "late-update"


REPO = Path(__file__).resolve().parents[2]
UPDATE_DELAY_S = 1.5
"""How late the dying trainer's update POST leaves: its first half of the round waits in the
sockets' buffers meanwhile (a tiny model's half fits there)."""


@pytest.mark.slow  # ~10 s: a JAX trainer process
def test_a_trainer_killed_mid_update_in_place_leaves_the_round_failed_and_incomplete(
    server, http: httpx.Client, tiny_llama: str, base_weights: dict[str, np.ndarray]
) -> None:
    """The interop lane's dying trainer (``tests/interop/dying_trainer.py``), in place
    (``stage_budget_bytes=0``), killed once it says ``PHASE mid_update``, its update POST held
    back by ``UPDATE_DELAY_S``: the phase must mean the update is in flight at the server
    (its worker read the bytes; was: half the tensors handed to the sockets, which a
    delayed POST had not reached, so the kill left the server no update to fail and the
    interop case waited for an incomplete round that never came). The worker fails the
    round on the dead link: the model is incomplete, named, generation refused, until a
    whole round commits (a round of the base weights here)."""
    failed = http.get("/weight_info").json()["session"]["rounds_failed"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DYING_TRAINER_UPDATE_DELAY_S": str(UPDATE_DELAY_S),
    }
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests/interop/dying_trainer.py"), server.url, tiny_llama,
         "mid_update", "9", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        lines: list[str] = []

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("PHASE"):
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(120)
        assert lines and lines[-1].strip() == "PHASE mid_update", "".join(lines[-30:])
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        while (info := http.get("/weight_info").json())["session"]["rounds_failed"] == failed:
            assert time.monotonic() < deadline, f"the round never failed: {info}"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(10)
    assert info["round_incomplete"] is True, info
    reason = info["incomplete_reason"]
    assert "the model holds an incomplete weight round" in reason, reason
    assert "round ended without its commit" in reason, reason
    refused = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert refused.status_code == 503, refused.text
    sender = TCPSender(VLLMStyleClient(server.url), replicas=1)
    try:
        sender.init()
        sender.round(base_weights, "whole-after-the-dying-trainer")
    finally:
        sender.close()
    info = http.get("/weight_info").json()
    assert (
        info["weight_version"] == "whole-after-the-dying-trainer" and not info["round_incomplete"]
    )
    assert (
        http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    )
