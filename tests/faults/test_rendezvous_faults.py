"""Rendezvous faults with real sockets: local clients that connect and say nothing must
not keep the real workers out of the IPC control channel's rendezvous."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

from weightwire.backends.ipc import channel as ipc_channel
from weightwire.backends.ipc.channel import Channel, Listener, dial

SECRET = bytes(range(128))


def _dial_later(port: int, out: list) -> threading.Thread:
    def run() -> None:
        try:
            out.append(dial("127.0.0.1", port, SECRET, timeout=20, peer="the trainer"))
        except BaseException as exc:  # the assertion below reports it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _idle(stack: ExitStack, port: int) -> socket.socket:
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=5))
    sock.settimeout(5)
    return sock


@contextmanager
def _joined_past_idle(n_idle: int) -> Iterator[tuple[Channel, Channel, list[socket.socket]]]:
    """``n_idle`` silent local connections, then a worker that dials; yields the two sides of
    the channel the rendezvous made (the worker did join) and the idle sockets. Both sides
    are aborted on the way out."""
    listener = Listener("127.0.0.1", SECRET)
    port = listener.address[1]
    with ExitStack() as stack:
        idle = [_idle(stack, port) for _ in range(n_idle)]
        out: list = []
        worker = _dial_later(port, out)
        try:
            (trainer_side,) = listener.accept(1, timeout=ipc_channel.HANDSHAKE_S * 0.8)
        finally:
            listener.close()
        worker.join(20)
        assert isinstance(out[0], Channel), out
        yield trainer_side, out[0], idle
        trainer_side.abort()
        out[0].abort()


def test_ipc_rendezvous_idle_local_connections_do_not_lock_the_worker_out() -> None:
    """IPC: four silent local connections opened before the worker dials. The worker
    joins (each connection proves the secret on its own, within its own deadline),
    well inside a rendezvous timeout shorter than one idle connection's allowance;
    the idle ones are dropped when the rendezvous ends."""
    with _joined_past_idle(4) as (trainer_side, worker_side, idle):
        worker_side.send({"op": "hello", "rank": 1})
        assert (
            trainer_side.expect("hello", deadline=_soon(), what="the worker's hello")["rank"] == 1
        )
        for sock in idle:  # each got its challenge, then EOF once the rendezvous was over
            assert len(_read_to_eof(sock)) == 4 + ipc_channel.NONCE_BYTES


def test_ipc_rendezvous_many_idle_connections_evict_the_oldest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """IPC: more silent connections than the pending cap; the oldest are dropped to make room
    and the worker still joins."""
    monkeypatch.setattr(ipc_channel, "_MAX_PENDING", 2)
    with _joined_past_idle(5) as (_, _, idle):
        for sock in idle:
            _read_to_eof(
                sock
            )  # ends: dropped (evicted or at the rendezvous' end), never left hanging


def _soon() -> float:
    return time.monotonic() + 5


def _read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data
