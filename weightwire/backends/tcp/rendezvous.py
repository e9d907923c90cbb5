"""The TCP rendezvous, both ends: rank 0 listens, authenticates every receiver and hands
over (``TCPRendezvous``); a receiver dials and proves the secret (``wire.dial``,
``wire.client_handshake``).

Each incoming connection is authenticated on its own short-lived thread, so a slow or
hostile client cannot hold up the legitimate receivers; ``accept`` returns once every
rank ``1 .. world_size-1`` has joined, or raises naming the ones that did not.

Idle connections cannot lock the workers out: a peer gets ``HANDSHAKE_S`` to prove
the secret (a real worker needs one round trip), and when ``_MAX_PENDING_HANDSHAKES``
unproven peers are pending the oldest is dropped to make room for the newcomer
(workers retry a handshake that was dropped, see ``tcp.worker.connect_tcp``).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from typing import TypedDict

from weightwire.backends.tcp import wire
from weightwire.backends.tcp.comm import TCPCommunicator, root_communicator
from weightwire.shared.errors import ConfigError, TransferError, TransferTimeout
from weightwire.shared.info import TCP_SECRET_BYTES, encode_secret
from weightwire.shared.limits import LIMITS

logger = logging.getLogger(__name__)

_MAX_PENDING_HANDSHAKES = 64  # unproven connections mid-handshake; beyond, the oldest is dropped
HANDSHAKE_S = 5.0
"""Seconds a connection has to complete the handshake (each step: hello out, AUTH in,
verdict out, confirm in), within the rendezvous' own deadline. Far above one loopback
or datacenter round trip; short enough that idle peers free their slots quickly."""
_ACCEPT_POLL_S = 0.1  # how often the acceptor thread notices accept() has finished


class ListenerFields(TypedDict):
    """What a receiver dials and proves (``TCPInitInfo``'s ``host``, ``port``, ``secret_b64``)."""

    host: str
    port: int
    secret_b64: str


class TCPRendezvous:
    """Listens for the receivers of one broadcast group; binds at construction.

    ``host``/``port`` are what receivers dial; ``secret`` (128 random bytes) is what they
    must prove. Neither the secret nor anything derived from it appears in ``repr``
    or logs.
    """

    def __init__(
        self,
        *,
        world_size: int,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        secret: bytes | None = None,
        socket_buffer_bytes: int | None = wire.DEFAULT_SOCKET_BUFFER_BYTES,
    ) -> None:
        if type(world_size) is not int or not 2 <= world_size <= LIMITS.max_world_size:
            raise ConfigError(
                f"world_size must be an int in [2, {LIMITS.max_world_size}], got {world_size!r}"
            )
        if type(port) is not int or not 0 <= port <= 65535:
            raise ConfigError(f"port must be an int in [0, 65535], got {port!r}")
        self._secret = wire.check_secret(
            secrets.token_bytes(TCP_SECRET_BYTES) if secret is None else secret
        )
        self.world_size = world_size
        self._buffer_bytes = socket_buffer_bytes
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            wire.tune(listener, socket_buffer_bytes)  # accepted sockets inherit the buffer sizes
            listener.bind((bind_host, port))
            listener.listen(min(world_size + 16, 4096))
        except OSError as exc:
            listener.close()
            raise TransferError(f"cannot listen on {bind_host}:{port}: {exc}") from None
        self._listener: socket.socket | None = listener
        self.port: int = listener.getsockname()[1]
        host = advertise_host or bind_host
        if host in ("0.0.0.0", "::", ""):
            listener.close()
            raise ConfigError(
                f"bind_host {bind_host!r} is not an address receivers can dial; pass advertise_host"
            )
        self.host: str = host
        self._cv = threading.Condition()
        self._state = "open"  # open -> accepting -> done | closed
        self._claimed: set[int] = set()
        self._joined: dict[int, tuple[socket.socket, str]] = {}
        self._pending: dict[socket.socket, bool] = {}
        """Connections mid-handshake, oldest first -> whether they proved the secret."""
        self._refusals: list[str] = []

    @property
    def secret(self) -> bytes:
        return self._secret

    def init_fields(self) -> ListenerFields:
        """The ``TCPInitInfo`` fields receivers need: ``host``, ``port``, ``secret_b64``."""
        return {"host": self.host, "port": self.port, "secret_b64": encode_secret(self._secret)}

    def accept(
        self,
        *,
        timeout: float,
        transfer_timeout: float | None = None,
        warmup_timeout: float | None = None,
    ) -> TCPCommunicator:
        """Wait until ranks ``1 .. world_size-1`` have all authenticated; then stop listening.

        Raises ``TransferTimeout`` naming the missing ranks (and any refused
        connections) if they have not all joined within ``timeout``.
        """
        limit = wire.positive_seconds("timeout", timeout)
        with self._cv:
            if self._state != "open":
                raise TransferError(
                    f"TCPRendezvous.accept() called on a rendezvous that is {self._state}"
                )
            self._state = "accepting"
        deadline = time.monotonic() + limit
        acceptor = threading.Thread(
            target=self._accept_loop, args=(deadline,), name="weightwire-tcp-accept", daemon=True
        )
        acceptor.start()
        want = self.world_size - 1
        with self._cv:
            self._cv.wait_for(
                lambda: len(self._joined) == want or self._state != "accepting",
                timeout=max(0.0, deadline - time.monotonic()),
            )
            complete = len(self._joined) == want and self._state == "accepting"
            if complete:
                self._state = "done"
                links = [(rank, sock, addr) for rank, (sock, addr) in self._joined.items()]
                self._joined.clear()
            missing = sorted(set(range(1, self.world_size)) - set(self._joined))
            refusals = list(self._refusals)
            state = self._state
            stragglers = list(self._pending)
        for sock in stragglers:  # half-done handshakes (mute or late clients): wake and drop them
            wire.shutdown_quietly(sock)
        acceptor.join(
            timeout=2 * _ACCEPT_POLL_S + 1
        )  # it polls the state; then its listener fd is free
        self._shut_listener()
        if not complete:
            self.close()
            if state == "closed":
                raise TransferError("TCPRendezvous was closed while accept() was waiting")
            extra = f"; refused: {'; '.join(refusals)}" if refusals else ""
            raise TransferTimeout(
                f"TCP rendezvous at {self.host}:{self.port}: "
                f"rank(s) {missing} of world_size {self.world_size} "
                f"did not join within {limit:g} s{extra}"
            )
        logger.info("TCP rendezvous at %s:%d: all %d receivers joined", self.host, self.port, want)
        return root_communicator(
            links, self.world_size, transfer_timeout=transfer_timeout, warmup_timeout=warmup_timeout
        )

    def close(self) -> None:
        """Stop listening and drop every connection not yet handed to a communicator."""
        with self._cv:
            accepting = self._state == "accepting"
            if self._state != "done":
                self._state = "closed"
            joined = [s for s, _ in self._joined.values()]
            pending = list(self._pending)
            self._joined.clear()
            self._cv.notify_all()
        if not accepting:  # else accept() closes it once its acceptor thread has left accept()
            self._shut_listener()
        for sock in pending:
            wire.shutdown_quietly(sock)  # wakes its handshake thread, which closes it
        for sock in joined:
            wire.shutdown_quietly(sock)
            sock.close()

    def __enter__(self) -> TCPRendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TCPRendezvous(host={self.host!r}, port={self.port}, "
            f"world_size={self.world_size}, state={self._state})"
        )

    # -- internals -------------------------------------------------------------------

    def _shut_listener(self) -> None:
        with self._cv:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def _accept_loop(self, deadline: float) -> None:
        with self._cv:
            listener = self._listener
        if listener is None:
            return
        listener.settimeout(_ACCEPT_POLL_S)
        while time.monotonic() < deadline:
            with self._cv:
                if self._state != "accepting":
                    return
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            evicted: socket.socket | None = None
            with self._cv:
                if self._state != "accepting":
                    conn.close()
                    continue
                unproven = [c for c, proven in self._pending.items() if not proven]
                if len(unproven) >= _MAX_PENDING_HANDSHAKES:
                    evicted = unproven[0]
                    del self._pending[evicted]  # its handshake thread closes it once woken
                self._pending[conn] = False
            if evicted is not None:
                wire.shutdown_quietly(evicted)
                logger.info(
                    "TCP rendezvous: %d unproven handshakes pending; dropped the oldest",
                    _MAX_PENDING_HANDSHAKES,
                )
            peer = _fmt_addr(addr)
            threading.Thread(
                target=self._handshake,
                args=(conn, peer, deadline),
                name="weightwire-tcp-handshake",
                daemon=True,
            ).start()

    def _handshake(self, conn: socket.socket, peer: str, rendezvous_deadline: float) -> None:
        claimed: int | None = None
        keep = False
        deadline = min(rendezvous_deadline, time.monotonic() + HANDSHAKE_S)
        try:
            wire.tune(conn, self._buffer_bytes)
            server_nonce = secrets.token_bytes(wire.NONCE_BYTES)
            hello = wire.HELLO.pack(wire.HELLO_MAGIC, wire.PROTOCOL_VERSION, server_nonce)
            wire.send_all(conn, [memoryview(hello)], deadline, [0])
            magic, rank, world_size, client_nonce, tag = wire.AUTH.unpack(
                wire.recv_exact(conn, wire.AUTH.size, deadline)
            )
            if magic != wire.AUTH_MAGIC:
                self._refuse(peer, "did not speak the weightwire TCP protocol")
                return
            code = self._judge(rank, world_size, server_nonce, client_nonce, tag)
            proof = (
                wire.server_tag(self._secret, client_nonce, server_nonce, rank, world_size)
                if code == wire.OK
                else bytes(32)
            )
            if code == wire.OK:
                claimed = rank
                with self._cv:
                    if conn in self._pending:
                        self._pending[conn] = True  # proven: never evicted to make room
            wire.send_all(
                conn,
                [memoryview(wire.VERDICT.pack(wire.VERDICT_MAGIC, code, proof))],
                deadline,
                [0],
            )
            if code != wire.OK:
                self._refuse(peer, f"claimed rank {rank}: {wire.REFUSALS[code]}")
                return
            confirm, _, _ = wire.FRAME.unpack(wire.recv_exact(conn, wire.FRAME.size, deadline))
            if confirm != wire.TAG_CONFIRM:
                self._refuse(
                    peer, f"rank {rank} sent {confirm!r} instead of confirming the handshake"
                )
                return
            with self._cv:
                if self._state == "accepting":
                    self._joined[rank] = (conn, peer)
                    self._pending.pop(conn, None)
                    keep = True
                    self._cv.notify_all()
        except (wire.WireShort, OSError) as exc:
            short = exc if isinstance(exc, wire.WireShort) else wire.WireShort(0, cause=str(exc))
            if claimed is not None:  # it dropped us after our proof: it holds a different secret
                self._refuse(
                    peer,
                    f"rank {claimed} rejected the sender's proof or left "
                    f"({short.cause or 'timeout'})",
                )
            else:
                logger.info("TCP rendezvous: connection from %s ended during the handshake", peer)
        finally:
            if not keep:
                with self._cv:
                    self._pending.pop(conn, None)
                    if claimed is not None and claimed not in self._joined:
                        self._claimed.discard(claimed)
                wire.shutdown_quietly(conn)
                conn.close()

    def _judge(
        self, rank: int, world_size: int, server_nonce: bytes, client_nonce: bytes, tag: bytes
    ) -> int:
        """Verdict for one AUTH.

        The secret first (an impostor learns nothing else), then rank and size.
        """
        expected = wire.client_tag(self._secret, server_nonce, client_nonce, rank, world_size)
        if not hmac.compare_digest(tag, expected):  # constant time
            return wire.BAD_SECRET
        if world_size != self.world_size:
            return wire.WORLD_SIZE_MISMATCH
        if not 1 <= rank < self.world_size:
            return wire.BAD_RANK
        with self._cv:
            if self._state != "accepting":
                return wire.CLOSED
            if rank in self._claimed:
                return wire.DUPLICATE_RANK
            self._claimed.add(rank)
        return wire.OK

    def _refuse(self, peer: str, reason: str) -> None:
        logger.warning("TCP rendezvous refused %s: %s", peer, reason)
        with self._cv:
            self._refusals.append(f"{peer} {reason}")


def _fmt_addr(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)
