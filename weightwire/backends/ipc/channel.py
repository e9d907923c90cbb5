"""The control channel of ``weightwire_ipc``: loopback TCP, small JSON messages.

Why not ``multiprocessing.connection``: its ``recv`` unpickles, and weightwire keeps
every pickling module out of the package (``tests/faults/test_security.py``). This is
a stdlib socket with a 4-byte big-endian length in front of each JSON message
(``MAX_MESSAGE_BYTES`` at most), and a mutual HMAC-SHA256 challenge over the session's
128-byte secret before any message: the worker proves it got the secret from the
init info, the trainer proves it is the one that minted it. Every wait is bounded; a
peer that dies closes its end and the other side raises ``PeerLost`` at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout

MAX_MESSAGE_BYTES = 1 << 20
NONCE_BYTES = 32
_POLL_S = 0.05
_CLIENT, _SERVER = b"weightwire-ipc/1 worker", b"weightwire-ipc/1 trainer"


class Channel:
    """One connection; single-threaded use, except ``abort`` (any thread)."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        with suppress(OSError):  # a message per piece: no Nagle delay (tests use Unix socket pairs)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._buf = bytearray()
        self.peer = peer
        self._aborted = False
        self._unread: list[dict[str, Any]] = []  # read, then handed back (``unread``)

    # -- raw frames -----------------------------------------------------------------

    def send_raw(self, payload: bytes, what: str) -> None:
        if self._aborted:
            raise TransferError(f"IPC control channel to {self.peer} was aborted")
        try:
            self._sock.settimeout(30.0)  # a few hundred bytes into a loopback socket buffer
            self._sock.sendall(len(payload).to_bytes(4, "big") + payload)
        except Exception as exc:
            if self._aborted:
                raise TransferError(f"IPC control channel to {self.peer} was aborted") from None
            raise PeerLost(
                f"lost {self.peer} while sending {what}: {type(exc).__name__}: {exc}"
            ) from None

    def _fill(self, n: int, deadline: float, what: str, alive: Callable[[], None] | None) -> None:
        while len(self._buf) < n:
            if alive is not None:
                alive()
            if self._aborted:
                raise TransferError(
                    f"IPC control channel to {self.peer} was aborted while waiting for {what}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(
                    f"{what} from {self.peer} did not arrive within the timeout "
                    "(is it alive and in the round?)"
                )
            try:
                self._sock.settimeout(min(left, _POLL_S))
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                continue
            except Exception as exc:
                if self._aborted:
                    raise TransferError(
                        f"IPC control channel to {self.peer} was aborted while waiting for {what}"
                    ) from None
                raise PeerLost(
                    f"lost {self.peer} while waiting for {what}: {type(exc).__name__}: {exc}"
                ) from None
            if not data:
                if self._aborted:
                    raise TransferError(
                        f"IPC control channel to {self.peer} was aborted while waiting for {what}"
                    )
                raise PeerLost(
                    f"{self.peer} closed the IPC control channel while this side waited for {what} "
                    "(the process exited or aborted its session)"
                )
            self._buf += data

    def recv_raw(
        self, *, deadline: float, what: str, alive: Callable[[], None] | None = None
    ) -> bytes:
        self._fill(4, deadline, what, alive)
        n = int.from_bytes(self._buf[:4], "big")
        if n > MAX_MESSAGE_BYTES:
            raise TransferError(
                f"{self.peer} sent a {n}-byte control message, over the limit {MAX_MESSAGE_BYTES}"
            )
        self._fill(4 + n, deadline, what, alive)
        raw = bytes(self._buf[4 : 4 + n])
        del self._buf[: 4 + n]
        return raw

    # -- JSON messages ------------------------------------------------------------------

    def send(self, msg: dict[str, Any]) -> None:
        self.send_raw(json.dumps(msg, separators=(",", ":")).encode(), repr(msg.get("op")))

    def recv(
        self, *, deadline: float, what: str, alive: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """The next message, or ``TransferTimeout`` at ``deadline`` / ``PeerLost`` at EOF."""
        if self._unread:
            return self._unread.pop()
        raw = self.recv_raw(deadline=deadline, what=what, alive=alive)
        try:
            msg = json.loads(raw)
        except ValueError:
            raise TransferError(f"{self.peer} sent a control message that is not JSON") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            raise TransferError(f"{self.peer} sent a control message without an 'op': {raw[:80]!r}")
        return msg

    def unread(self, msg: dict[str, Any]) -> None:
        """Hand ``msg`` back: the next ``recv`` returns it (one reader looked at a message
        that another part of the round handles)."""
        self._unread.append(msg)

    def discard_delivered(self, op: str) -> int:
        """Drop the ``op`` messages at the head of what was already delivered to this
        side, without waiting (what the peer sent earlier and nobody read: a loopback
        send lands at once); the first other message stays to be read. Returns how many."""
        try:
            self._sock.setblocking(False)
            while True:
                data = self._sock.recv(1 << 16)
                if not data:
                    break  # EOF: the next blocking recv reports it with its context
                self._buf += data
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            if self._aborted:
                raise TransferError(f"IPC control channel to {self.peer} was aborted") from None
            raise PeerLost(f"lost {self.peer}: {type(exc).__name__}: {exc}") from None
        dropped = 0
        while len(self._buf) >= 4:
            n = int.from_bytes(self._buf[:4], "big")
            if n > MAX_MESSAGE_BYTES or len(self._buf) < 4 + n:
                break  # an oversized frame is refused by the next recv, by name
            try:
                head = json.loads(bytes(self._buf[4 : 4 + n]))
            except ValueError:
                break
            if not isinstance(head, dict) or head.get("op") != op:
                break
            del self._buf[: 4 + n]
            dropped += 1
        return dropped

    def expect(
        self, op: str, *, deadline: float, what: str, alive: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        msg = self.recv(deadline=deadline, what=what, alive=alive)
        if msg["op"] != op:
            raise TransferError(
                f"{self.peer} sent {msg['op']!r} where {what} ({op!r}) was due: "
                "the two sides disagree on the round"
            )
        return msg

    def abort(self) -> None:
        self._aborted = True
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a recv in another thread
        with suppress(OSError):
            self._sock.close()

    close = abort


def _tag(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + first + second, hashlib.sha256).digest()


def accept_handshake(ch: Channel, secret: bytes, deadline: float) -> None:
    """Trainer side: challenge the worker, check its proof, prove ourselves."""
    mine = secrets.token_bytes(NONCE_BYTES)
    ch.send_raw(mine, "the challenge")
    answer = ch.recv_raw(deadline=deadline, what="the worker's proof")
    theirs, proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if len(theirs) != NONCE_BYTES or not hmac.compare_digest(
        proof, _tag(secret, _CLIENT, mine, theirs)
    ):
        raise TransferError(f"{ch.peer} did not prove the session secret; connection refused")
    ch.send_raw(_tag(secret, _SERVER, theirs, mine), "the trainer's proof")


def dial(host: str, port: int, secret: bytes, *, timeout: float, peer: str) -> Channel:
    """Worker side: connect, answer the challenge, check the trainer's proof (bounded)."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=max(0.1, min(timeout, 30.0)))
    except OSError as exc:
        raise TransferError(f"cannot connect to {peer}: {exc}") from None
    ch = Channel(sock, peer)
    try:
        challenge = ch.recv_raw(deadline=deadline, what="the challenge")
        if len(challenge) != NONCE_BYTES:
            raise TransferError(f"{peer} is not a weightwire IPC trainer (bad challenge)")
        mine = secrets.token_bytes(NONCE_BYTES)
        ch.send_raw(mine + _tag(secret, _CLIENT, challenge, mine), "the proof")
        proof = ch.recv_raw(deadline=deadline, what="the trainer's proof")
        if not hmac.compare_digest(proof, _tag(secret, _SERVER, mine, challenge)):
            raise TransferError(
                f"{peer} did not prove the session secret; refusing to receive weights from it"
            )
    except BaseException:
        ch.abort()
        raise
    return ch


HANDSHAKE_S = 10.0
"""Seconds one connection has to prove the secret (a real worker needs one loopback round trip)."""
_MAX_PENDING = 64  # unproven connections mid-handshake; beyond, the oldest is dropped to make room


class Listener:
    """Loopback listener accepting ``want`` authenticated workers before a deadline.

    Each connection proves the secret on its own thread within ``HANDSHAKE_S``, so idle or
    hostile local connections cannot hold the real workers up: they only ever cost their
    own slot, and with ``_MAX_PENDING`` of them pending the oldest is dropped.
    """

    def __init__(self, bind_host: str, secret: bytes) -> None:
        self._sock = socket.create_server((bind_host, 0))
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._secret = secret
        self._closed = threading.Event()
        self._cv = threading.Condition()
        self._pending: list[Channel] = []  # mid-handshake, oldest first
        self._proven: list[Channel] = []
        self._refused: list[str] = []

    def accept(self, want: int, *, timeout: float) -> list[Channel]:
        deadline = time.monotonic() + timeout
        try:
            while True:
                with self._cv:
                    if len(self._proven) >= want:
                        got, self._proven = self._proven[:want], self._proven[want:]
                        return got
                if self._closed.is_set():
                    raise TransferError(
                        "the IPC rendezvous was cancelled (the init request failed)"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    with self._cv:
                        missing, refused = want - len(self._proven), list(self._refused)
                    why = f"; refused: {'; '.join(refused[:3])}" if refused else ""
                    raise TransferTimeout(
                        f"IPC rendezvous: {missing} of {want} worker(s) did not join "
                        f"within {timeout:g} s{why}"
                    )
                try:
                    self._sock.settimeout(min(left, _POLL_S))
                    sock, addr = self._sock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._closed.is_set():
                        raise TransferError(
                            "the IPC rendezvous was cancelled (the init request failed)"
                        ) from None
                    raise
                self._start_handshake(
                    Channel(sock, f"IPC worker connection from {addr[0]}:{addr[1]}"), deadline
                )
        finally:
            self._drop_all()  # stragglers mid-handshake, and on failure every proven one

    def _start_handshake(self, ch: Channel, deadline: float) -> None:
        with self._cv:
            evicted = self._pending.pop(0) if len(self._pending) >= _MAX_PENDING else None
            self._pending.append(ch)
        if evicted is not None:
            evicted.abort()  # wakes its handshake thread, which gives up
        threading.Thread(
            target=self._handshake,
            args=(ch, min(deadline, time.monotonic() + HANDSHAKE_S)),
            name="weightwire-ipc-handshake",
            daemon=True,
        ).start()

    def _handshake(self, ch: Channel, deadline: float) -> None:
        try:
            accept_handshake(ch, self._secret, deadline)
        except TransferError as exc:  # a stray, wrong or idle client: the real ones keep joining
            with self._cv:
                self._refused.append(str(exc))
                if ch in self._pending:
                    self._pending.remove(ch)
            ch.abort()
            return
        with self._cv:
            if ch in self._pending:  # else accept() ended or evicted it meanwhile
                self._pending.remove(ch)
                self._proven.append(ch)
                return
        ch.abort()

    def _drop_all(self) -> None:
        with self._cv:
            drop, self._pending, self._proven = self._pending + self._proven, [], []
        for ch in drop:
            ch.abort()

    def close(self) -> None:
        self._closed.set()
        with suppress(OSError):
            self._sock.close()
        self._drop_all()


def check_int(msg: dict[str, Any], key: str, lo: int, hi: int, peer: str) -> int:
    value = msg.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise TransferError(
            f"{peer} sent {msg.get('op')!r} with {key}={value!r}, outside [{lo}, {hi}]"
        )
    return value
