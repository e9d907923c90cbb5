"""Idle connections to the trainer's TCP rendezvous cannot lock the real workers out.

A flood of peers that connect and say nothing must neither hold a handshake slot past
``HANDSHAKE_S`` nor keep a real worker from joining; a worker whose handshake the
sender dropped retries within its ``connect_s``.
"""

from __future__ import annotations

import contextlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tcp_pairs import dial

from weightwire.backends.tcp import rendezvous as tcp_rendezvous
from weightwire.backends.tcp import wire
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.shared.errors import PeerLost


def idle_peer(rendezvous: TCPRendezvous) -> socket.socket:
    """Connect and read the sender's hello (so the connection is accepted and pending),
    then say nothing."""
    sock = socket.create_connection((rendezvous.host, rendezvous.port), timeout=20)
    wire.recv_exact(sock, wire.HELLO.size, time.monotonic() + 20)
    return sock


def test_a_flood_of_idle_peers_does_not_lock_the_worker_out() -> None:
    n = tcp_rendezvous._MAX_PENDING_HANDSHAKES + 8
    rendezvous = TCPRendezvous(world_size=2)
    idle: list[socket.socket] = []
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(rendezvous.accept, timeout=60)
        try:
            idle = [idle_peer(rendezvous) for _ in range(n)]  # every slot taken (and then some)
            worker = dial(rendezvous, 1, timeout=20)
            root = accepted.result(timeout=30)
        finally:
            for sock in idle:
                sock.close()
    assert (root.world_size, worker.rank) == (2, 1)
    root.close()
    worker.close()


def test_an_unproven_peer_is_dropped_after_the_handshake_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp_rendezvous, "HANDSHAKE_S", 0.2)
    rendezvous = TCPRendezvous(world_size=2)
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(rendezvous.accept, timeout=60)
        sock = idle_peer(rendezvous)
        sock.settimeout(
            30
        )  # far below accept's 60 s: only the handshake deadline can close it in time
        try:
            assert sock.recv(1) == b"", (
                "the sender sent more than its hello to a peer that never authenticated"
            )
        finally:
            sock.close()
        worker = dial(rendezvous, 1, timeout=20)
        root = accepted.result(timeout=30)
    root.close()
    worker.close()


def test_worker_retries_a_dropped_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker side (``connect_tcp``): the first handshake is dropped by the sender, the
    retry joins; a refusal is not retried."""
    torch = pytest.importorskip("torch")
    from weightwire.backends.tcp import worker as tcp_worker
    from weightwire.backends.tcp.info import TCPInitInfo
    from weightwire.shared.info import encode_secret

    rendezvous = TCPRendezvous(world_size=2)
    info = TCPInitInfo(
        host=rendezvous.host,
        port=rendezvous.port,
        secret_b64=encode_secret(rendezvous.secret),
        world_size=2,
        rank_offset=1,
    )
    real = TCPCommunicator.connect
    calls: list[int] = []

    def dropped_once(**kw: object) -> TCPCommunicator:
        calls.append(1)
        if len(calls) == 1:
            raise PeerLost("lost rank 0 (sender) during the handshake: connection closed by peer")
        return real(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(TCPCommunicator, "connect", staticmethod(dropped_once))

    def sender() -> TCPCommunicator:
        root = rendezvous.accept(timeout=60)
        root.warmup(timeout=30)  # the worker warms up inside connect_tcp
        return root

    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(sender)
        link = tcp_worker.connect_tcp(info, rank=1, device=torch.device("cpu"))
        root = accepted.result(timeout=30)
    assert len(calls) == 2
    with contextlib.suppress(Exception):
        link.close()
    root.close()
