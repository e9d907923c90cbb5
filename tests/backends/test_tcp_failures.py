"""TCP data plane failures: refused peers, lost peers, stalls, aborts. Each ends in a
clear ``TransferError`` within its timeout, never a hang or silent garbage."""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tcp_pairs import accepted, dial
from test_tcp_peer import Peers

from weightwire.backends.tcp import wire
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout


def raw_auth(rendezvous: TCPRendezvous, rank: int, world_size: int) -> int:
    """A hand-rolled client with the right secret claiming any rank; returns the verdict code."""
    with socket.create_connection((rendezvous.host, rendezvous.port), timeout=10) as sock:
        deadline = time.monotonic() + 10
        _, _, server_nonce = wire.HELLO.unpack(wire.recv_exact(sock, wire.HELLO.size, deadline))
        nonce = secrets.token_bytes(32)
        tag = wire.client_tag(rendezvous.secret, server_nonce, nonce, rank, world_size)
        sock.sendall(wire.AUTH.pack(wire.AUTH_MAGIC, rank, world_size, nonce, tag))
        _, code, _ = wire.VERDICT.unpack(wire.recv_exact(sock, wire.VERDICT.size, deadline))
        return code


def test_wrong_secret_is_refused_on_both_sides_and_accept_waits_for_the_real_receiver(caplog):
    rendezvous = TCPRendezvous(world_size=2)
    with (
        ThreadPoolExecutor(1) as pool,
        caplog.at_level(logging.WARNING, logger="weightwire.backends.tcp.rendezvous"),
    ):
        accepted = pool.submit(rendezvous.accept, timeout=20)
        with pytest.raises(TransferError, match=r"refused rank 1 \(world_size 2\): wrong secret"):
            dial(rendezvous, 1, secret=secrets.token_bytes(128))
        assert not accepted.done()
        good = dial(rendezvous, 1)
        root = accepted.result(timeout=20)
    assert re.search(r"refused 127\.0\.0\.1:\d+: claimed rank 1: wrong secret", caplog.text)
    assert rendezvous.init_fields()["secret_b64"] not in caplog.text
    assert root.world_size == 2 and good.rank == 1
    root.close()
    good.close()


def test_accept_times_out_naming_missing_rank_and_the_refusal():
    rendezvous = TCPRendezvous(world_size=2)
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(rendezvous.accept, timeout=1.5)
        with pytest.raises(TransferError, match="wrong secret"):
            dial(rendezvous, 1, secret=bytes(128))
        with pytest.raises(
            TransferTimeout,
            match=(
                r"rank\(s\) \[1\] of world_size 2 did not join within 1.5 s; "
                r"refused: .*wrong secret"
            ),
        ):
            accepted.result(timeout=10)


def test_receiver_refuses_a_sender_that_cannot_prove_the_secret():
    """A listener at the advertised address that never knew the secret must get no weights."""
    secret = secrets.token_bytes(128)
    fake = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []

    def impostor() -> None:
        conn, _ = fake.accept()
        with conn:
            deadline = time.monotonic() + 10
            conn.sendall(
                wire.HELLO.pack(wire.HELLO_MAGIC, wire.PROTOCOL_VERSION, secrets.token_bytes(32))
            )
            wire.recv_exact(conn, wire.AUTH.size, deadline)
            conn.sendall(wire.VERDICT.pack(wire.VERDICT_MAGIC, wire.OK, secrets.token_bytes(32)))
            with contextlib.suppress(wire.WireShort):  # the receiver hangs up instead of confirming
                seen.append(wire.recv_exact(conn, wire.FRAME.size, deadline))

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(
        TransferError, match="did not prove the shared secret; refusing to receive weights"
    ):
        TCPCommunicator.connect(
            host="127.0.0.1",
            port=fake.getsockname()[1],
            secret=secret,
            rank=1,
            world_size=2,
            timeout=10,
        )
    thread.join(timeout=10)
    fake.close()
    assert seen == []


def test_rank_handling_duplicates_out_of_range_and_world_size():
    rendezvous = TCPRendezvous(world_size=3)
    with ThreadPoolExecutor(2) as pool:
        accepted = pool.submit(rendezvous.accept, timeout=2)
        first = dial(rendezvous, 1)
        with pytest.raises(TransferError, match="refused rank 1 .*rank already connected"):
            dial(rendezvous, 1)
        with pytest.raises(TransferError, match="world_size differs"):
            dial(rendezvous, 2, world_size=4)
        assert raw_auth(rendezvous, 3, 3) == wire.BAD_RANK
        assert raw_auth(rendezvous, 0, 3) == wire.BAD_RANK
        with pytest.raises(TransferTimeout, match=r"rank\(s\) \[2\] of world_size 3 did not join"):
            accepted.result(timeout=10)
    first.close()
    with pytest.raises(ValueError, match=r"receiver rank must be an int in \[1, 3\)"):
        dial(rendezvous, 3)
    with pytest.raises(ValueError, match="128 bytes"):
        dial(rendezvous, 1, secret=b"short")


def test_receiver_that_never_connects_times_out_accept_naming_missing_ranks():
    rendezvous = TCPRendezvous(world_size=4)
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(rendezvous.accept, timeout=1.0)
        two = dial(rendezvous, 2)
        with pytest.raises(
            TransferTimeout, match=r"rank\(s\) \[1, 3\] of world_size 4 did not join within 1 s"
        ):
            accepted.result(timeout=10)
    with pytest.raises(PeerLost, match=r"lost rank 0 \(sender at 127.0.0.1:\d+\) before warm-up"):
        two.warmup(timeout=5)  # the rendezvous dropped it: no hang


def test_silent_connection_does_not_block_the_rendezvous():
    rendezvous = TCPRendezvous(world_size=2)
    mute = socket.create_connection((rendezvous.host, rendezvous.port))
    with ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(rendezvous.accept, timeout=10)
        time.sleep(0.2)
        good = dial(rendezvous, 1)
        root = accepted.result(timeout=10)
    mute.settimeout(10)
    assert len(wire.recv_exact(mute, wire.HELLO.size, time.monotonic() + 10)) == wire.HELLO.size
    assert mute.recv(1) == b""  # dropped once accept() finished, not left holding a thread
    mute.close()
    root.close()
    good.close()


def test_connect_times_out_when_nobody_accepts():
    rendezvous = TCPRendezvous(world_size=2)  # listening, but accept() never called
    with pytest.raises(TransferTimeout, match="handshake .* did not finish in time"):
        dial(rendezvous, 1, timeout=0.5)
    port = rendezvous.port
    rendezvous.close()
    with pytest.raises(
        TransferTimeout, match=f"could not connect to the TCP sender at 127.0.0.1:{port}"
    ):
        TCPCommunicator.connect(
            host="127.0.0.1", port=port, secret=bytes(128), rank=1, world_size=2, timeout=0.5
        )


def _pair() -> tuple[TCPCommunicator, TCPCommunicator]:
    root, (recv,) = accepted(TCPRendezvous(world_size=2))
    return root, recv


def test_warmup_times_out_naming_the_rank_that_never_said_ready():
    root, recv = _pair()
    with pytest.raises(
        TransferTimeout, match=r"warm-up: no ready from rank 1 \(127.0.0.1:\d+\) within 0.5 s"
    ):
        root.warmup(timeout=0.5)
    with pytest.raises(PeerLost, match="lost rank 0"):
        recv.warmup(timeout=5)  # the root aborted, so the receiver fails fast too


def test_stalled_receiver_makes_broadcast_time_out():
    root, recv = _pair()  # recv never reads: kernel buffers fill, then the sender must give up
    start = time.monotonic()
    with pytest.raises(
        TransferTimeout,
        match=(
            r"broadcast #0 of 268435456 bytes did not reach every receiver within 1 s; "
            r"still sending to: rank 1 \(127.0.0.1:\d+\) at byte \d+"
        ),
    ):
        root.broadcast(np.zeros(256 << 20, dtype=np.uint8), timeout=1.0)
    assert time.monotonic() - start < 10
    with pytest.raises(TransferError, match="aborted"):
        root.broadcast(b"x")
    recv.close()


def test_abort_wakes_a_blocked_receiver():
    root, recv = _pair()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(recv.broadcast, np.empty(10, dtype=np.uint8), timeout=60)
        time.sleep(0.2)
        with pytest.raises(RuntimeError, match="must be sequential"):
            recv.warmup(timeout=1)  # frames of two calls would interleave on one stream
        recv.abort()
        with pytest.raises(TransferError, match="aborted"):
            fut.result(timeout=5)
    root.close()


def test_receiver_killed_mid_transfer_makes_the_sender_raise():
    with Peers() as peers, TCPRendezvous(world_size=3) as rendezvous:
        config = {
            **rendezvous.init_fields(),
            "world_size": 3,
            "packed": True,
            "buffer_size": 1 << 20,
            "metas": [{"name": "w", "dtype": "uint8", "shape": [128 << 20]}],
        }
        healthy = peers.spawn("recv", {**config, "rank": 1})
        doomed = peers.spawn("recv", {**config, "rank": 2, "stall": True})
        root = rendezvous.accept(timeout=60)
        root.warmup(timeout=60)
        doomed.expect("warm")
        killer = threading.Timer(0.5, doomed.kill)
        killer.start()
        with pytest.raises(TransferError, match=r"rank 2 \(127.0.0.1:\d+\)") as info:
            root.broadcast(np.zeros(128 << 20, dtype=np.uint8), timeout=60)
        killer.join()
        assert isinstance(info.value, PeerLost), info.value
        assert re.search(r"at byte \d+ of 134217728 of broadcast #0", str(info.value))
        healthy.result(timeout=30)  # finishes (bytes or a PeerLost), never hangs


def test_sender_killed_mid_transfer_makes_receivers_raise_peer_lost(tmp_path):
    total = 128 << 20
    go = tmp_path / "read-now"
    with Peers() as peers:
        sender = peers.spawn("send", {"world_size": 3, "nbytes": total})
        fields = sender.expect("listening")
        del fields["event"]
        config = {
            **fields,
            "world_size": 3,
            "packed": True,
            "buffer_size": 1 << 20,
            "go_file": str(go),  # the receivers read only once the sender is dead
            "metas": [{"name": "w", "dtype": "uint8", "shape": [total]}],
        }
        receivers = [peers.spawn("recv", {**config, "rank": r}) for r in (1, 2)]
        sender.expect("sending")
        time.sleep(0.3)  # sender blocked on full socket buffers; receivers have not started reading
        sender.kill()
        go.touch()  # was: the receivers read after 1.5 s of their own, however late the kill came
        for receiver in receivers:
            receiver.expect("warm")
            result = receiver.result(timeout=30)
            assert result["type"] == "PeerLost", result
            match = re.search(
                rf"lost rank 0 \(sender at 127.0.0.1:\d+\) at byte (\d+) "
                rf"of {total} of broadcast #0",
                result["error"],
            )
            assert match, result["error"]
            assert 0 < int(match.group(1)) < total


@pytest.mark.parametrize("end", ["abort", "close"])
def test_a_sender_gone_after_bytes_nobody_read_counts_as_closed(end: str) -> None:
    """A trainer that gave a round up after its first broadcast, before its workers' update
    read it: its bytes wait unread in the receiver's socket, and the receiver must still see
    the trainer gone (a server then drops the round at once, not at its lease)."""
    root, (one, two) = accepted(TCPRendezvous(world_size=3))
    try:
        threads = [threading.Thread(target=c.warmup, kwargs={"timeout": 10}) for c in (one, two)]
        for t in threads:
            t.start()
        root.warmup(timeout=10)
        for t in threads:
            t.join(10)
        assert not one.peer_closed() and not two.peer_closed()
        assert one.bytes_unread() == 0
        root.broadcast(np.arange(64, dtype=np.uint8), timeout=10)  # nobody receives it
        assert not one.peer_closed(), "bytes waiting from a live sender are not a close"
        deadline = time.monotonic() + 5  # the frame and its 64 bytes wait unread
        while one.bytes_unread() < wire.FRAME.size + 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert one.bytes_unread() == wire.FRAME.size + 64
        getattr(root, end)()
        deadline = time.monotonic() + 5
        while not (one.peer_closed() and two.peer_closed()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert one.peer_closed() and two.peer_closed()
    finally:
        for c in (root, one, two):
            c.close()


def test_a_round_whose_trainer_bytes_wait_unread_past_its_transfer_bound_is_stale() -> None:
    """``stale_reason``: a round with no update for longer than the link's transfer bound
    while the trainer's bytes wait unread is stale (a live trainer's send of them gave up
    at that bound; one that died mid-send keeps its FIN queued behind them, so
    ``peer_closed`` stays false); within the bound, or with nothing waiting, it is not."""
    from weightwire.backends.worker_base import ReceiveLink
    from weightwire.torch_side.worker.session import stale_reason

    class Link(ReceiveLink):
        waiting = True

        def receive(self, turn, progress):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def bytes_unread(self) -> bool:
            return self.waiting

        def abort(self) -> None:
            pass

        def close(self) -> None:
            pass

    link = Link(device=None, timeout_s=2.0, depth=1)
    now = time.monotonic()
    why = stale_reason(link, now - 3.0, lease_s=300)
    assert why is not None and "bytes wait unread on the data link with no update for 3 s" in why
    assert "past its transfer bound (2 s)" in why
    assert stale_reason(link, now - 1.0, lease_s=300) is None  # a late update may still come
    link.waiting = False
    assert stale_reason(link, now - 3.0, lease_s=300) is None  # idle, nothing sent: the lease
