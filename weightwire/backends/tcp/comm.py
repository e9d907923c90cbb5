"""TCP data plane: rank 0 (the trainer) broadcasts host buffers to every receiver.

Stdlib sockets on purpose: no extra dependency on either side, zero-copy
``sendmsg(memoryview)`` / ``recv_into`` a preallocated buffer, and a broadcast from
one sender needs nothing more than one connection per receiver (no collectives
library, no message broker). The wire format (HMAC handshake, and the 16-byte header
``tag | seq | length`` in front of every broadcast that turns a framing disagreement
into an error instead of misloaded weights) is documented in
``weightwire.backends.tcp.wire``.

Rank 0 sends to several receivers concurrently: its calling thread serves the first
link and one persistent thread per further link serves the rest (no thread per
broadcast). One warmup/broadcast at a time per communicator; ``abort`` may come from
any thread.

Failure contract: every wait is bounded by a timeout; a lost peer raises ``PeerLost``
naming the peer and byte offset, a timeout ``TransferTimeout``, a desynchronized
stream or refused handshake ``TransferError``. After any of them the communicator is
aborted (every socket shut down) and later calls raise.
"""

from __future__ import annotations

import fcntl
import logging
import select
import selectors
import socket
import struct
import termios
import threading
import time
from typing import Any

from weightwire.backends.tcp import wire
from weightwire.backends.tcp.links import LinkGroup, PeerLink
from weightwire.shared.errors import TransferError, TransferTimeout
from weightwire.shared.limits import LIMITS
from weightwire.shared.timeouts import DEFAULT_TIMEOUTS

__all__ = ["SOCKET_BUFFER_BYTES", "TCPCommunicator"]

logger = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = wire.DEFAULT_SOCKET_BUFFER_BYTES


_HUNG_UP = getattr(select, "POLLRDHUP", 0)
"""The peer shut its sending side (Linux); elsewhere only an EOF peek tells (0: not asked)."""


class _Batch:
    """Completion of one broadcast across links; the first error wins."""

    def __init__(self, ranks: set[int]) -> None:
        self.cv = threading.Condition()
        self.pending = set(ranks)
        self.error: TransferError | None = None

    def done(self, rank: int, error: TransferError | None) -> None:
        with self.cv:
            self.pending.discard(rank)
            if error is not None and self.error is None:
                self.error = error
            self.cv.notify_all()

    def wait(self, deadline: float) -> bool:
        with self.cv:
            return self.cv.wait_for(
                lambda: not self.pending or self.error is not None,
                timeout=max(0.0, deadline - time.monotonic()),
            )


class TCPCommunicator(LinkGroup):
    """One rank's end of a TCP broadcast group (``shared.communicator.Communicator``).

    Build it with ``TCPRendezvous.accept`` (rank 0) or ``TCPCommunicator.connect``
    (receivers). Only rank 0 broadcasts. Holds no secret after the handshake.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        links: list[PeerLink],
        transfer_timeout: float | None = None,
        warmup_timeout: float | None = None,
    ) -> None:
        self._transfer_timeout = wire.positive_seconds(
            "transfer_timeout",
            DEFAULT_TIMEOUTS.transfer_s if transfer_timeout is None else transfer_timeout,
        )
        self._warmup_timeout = wire.positive_seconds(
            "warmup_timeout",
            DEFAULT_TIMEOUTS.warmup_s if warmup_timeout is None else warmup_timeout,
        )
        super().__init__(rank=rank, world_size=world_size, links=links)
        self._seq = 0
        self.hellos: dict[int, bytes] = {}
        """Root: each receiver's hello (its warm-up ready's payload; empty: none), by rank."""
        self._workers: list[threading.Thread] = []
        if rank == 0:  # the caller's thread serves links[0]; one persistent thread per other link
            for link in links[1:]:
                worker = threading.Thread(
                    target=self._serve,
                    args=(link,),
                    name=f"weightwire-tcp-send-{link.rank}",
                    daemon=True,
                )
                worker.start()
                self._workers.append(worker)

    # -- construction (receiver side) ------------------------------------------------

    @classmethod
    def connect(
        cls,
        *,
        host: str,
        port: int,
        secret: bytes,
        rank: int,
        world_size: int,
        timeout: float,
        transfer_timeout: float | None = None,
        warmup_timeout: float | None = None,
        socket_buffer_bytes: int | None = SOCKET_BUFFER_BYTES,
    ) -> TCPCommunicator:
        """Dial the sender, prove the secret, verify the sender's proof; bounded by ``timeout``."""
        wire.check_secret(secret)
        if type(world_size) is not int or not 2 <= world_size <= LIMITS.max_world_size:
            raise ValueError(
                f"world_size must be an int in [2, {LIMITS.max_world_size}], got {world_size!r}"
            )
        if type(rank) is not int or not 1 <= rank < world_size:
            raise ValueError(f"receiver rank must be an int in [1, {world_size}), got {rank!r}")
        deadline = time.monotonic() + wire.positive_seconds("timeout", timeout)
        where = f"rank 0 (sender at {host}:{port})"
        sock = wire.dial(host, port, deadline, socket_buffer_bytes)
        try:
            wire.client_handshake(sock, secret, rank, world_size, deadline, where)
        except BaseException:
            sock.close()
            raise
        logger.info("TCP rank %d joined %s", rank, where)
        return cls(
            rank=rank,
            world_size=world_size,
            links=[PeerLink(0, sock, f"sender at {host}:{port}")],
            transfer_timeout=transfer_timeout,
            warmup_timeout=warmup_timeout,
        )

    # -- Communicator protocol -------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def warmup(self, *, timeout: float | None = None, hello: bytes = b"") -> None:
        """Every receiver says ready, then the root says go.

        Thus all peers are present before any broadcast. A receiver's ``hello`` rides on its
        ready; the root keeps each in ``hellos``.
        """
        limit = (
            self._warmup_timeout if timeout is None else wire.positive_seconds("timeout", timeout)
        )
        deadline = time.monotonic() + limit
        self._enter()
        try:
            if self._rank == 0:
                self._root_warmup(deadline, limit)
            else:
                ready = wire.frame(wire.TAG_READY, 0, len(hello))
                self._send(self._links[0], [ready, hello], deadline, "warm-up")
                self._expect(
                    self._links[0], wire.TAG_GO, deadline, limit, "warm-up (waiting for go)"
                )
        finally:
            self._leave()

    def broadcast(
        self, buffer: Any, *, root: int = 0, timeout: float | None = None, stream: Any = None
    ) -> None:
        """Root: send ``buffer`` (or a list of parts, one logical buffer) to every receiver
        concurrently; returns once the bytes are handed to the kernel. Receiver: fill
        ``buffer`` (or its parts, in order) with exactly that many bytes. ``stream`` is
        ignored: TCP is always synchronous."""
        del stream
        if root != 0:
            raise ValueError(f"the TCP communicator broadcasts only from rank 0, got root={root}")
        views = wire.byte_views(buffer, writable=self._rank != 0)
        nbytes = sum(len(v) for v in views)
        limit = (
            self._transfer_timeout if timeout is None else wire.positive_seconds("timeout", timeout)
        )
        deadline = time.monotonic() + limit
        self._enter()
        seq, self._seq = self._seq, (self._seq + 1) & 0xFFFFFFFF
        try:
            if self._rank == 0:
                self._root_broadcast(views, nbytes, seq, deadline, limit)
            else:
                self._recv_broadcast(views, nbytes, seq, deadline, limit)
        finally:
            self._leave()

    def peer_closed(self) -> bool:
        """True if this communicator is closed or a peer closed its connection (checked
        without blocking or consuming data). Lets a worker see that its trainer is gone, and
        a trainer that a worker dropped it (another trainer took the session over).

        A peer that closed after sending bytes nobody read (a trainer that gave a round up
        after its first broadcast, before its workers' update read it) leaves the socket
        readable with data, so a peek alone would call it connected until the round's lease:
        Linux says the peer hung up (``POLLRDHUP``) whatever is still queued."""
        if self._state != "open":
            return True
        for link in self._links:
            try:
                poller = select.poll()
                poller.register(link.sock, select.POLLIN | _HUNG_UP)
                events = poller.poll(0)
                if not events:
                    continue  # nothing to read: the peer is still there
                if events[0][1] & (_HUNG_UP | select.POLLHUP | select.POLLERR):
                    return True
                # Readable with no data means an orderly close (EOF).
                if link.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return True
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return True
        return False

    def bytes_unread(self) -> int:
        """Bytes a peer sent that wait unread in this end's receive queues (``FIONREAD``;
        checked without blocking or consuming them). Between a worker's receives it tells a
        trainer's broadcast that no update reads: a trainer that died mid-send keeps its
        close queued behind them (a full receive window holds back its FIN, so
        ``peer_closed`` stays false) until they are read."""
        if self._state != "open":
            return 0
        waiting = 0
        for link in self._links:
            try:
                waiting += _unread(link.sock)
            except OSError:
                continue  # a closed socket: peer_closed tells that
        return waiting

    def __enter__(self) -> TCPCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        peers = ", ".join(str(link) for link in self._links)
        return (
            f"TCPCommunicator(rank={self._rank}, world_size={self._world_size}, "
            f"state={self._state}, peers=[{peers}])"
        )

    # -- root ------------------------------------------------------------------------

    def _root_broadcast(
        self, views: list[wire.ByteView], nbytes: int, seq: int, deadline: float, limit: float
    ) -> None:
        payload = [memoryview(wire.frame(wire.TAG_BROADCAST, seq, nbytes)), *views]
        batch = _Batch({link.rank for link in self._links})
        job = (payload, deadline, batch, seq, nbytes, limit)
        with self._lock:  # queued while open, so each job precedes teardown's stop sentinel
            if self._state != "open":
                raise TransferError(
                    f"TCP communicator (rank 0) was {self._state} before broadcast #{seq}"
                )
            self._active += len(self._links) - 1  # released by each worker when its job ends
            for link in self._links[1:]:
                link.jobs.put(job)
        self._send_job(self._links[0], *job)
        if not batch.wait(deadline):
            raise self._fail(self._timeout_error(batch, seq, nbytes, limit))
        if batch.error is not None:
            raise self._fail(batch.error)

    def _serve(self, link: PeerLink) -> None:
        while (job := link.jobs.get()) is not None:
            try:
                self._send_job(link, *job)
            finally:
                self._exit()

    def _send_job(
        self,
        link: PeerLink,
        payload: list[wire.ByteView],
        deadline: float,
        batch: _Batch,
        seq: int,
        nbytes: int,
        limit: float,
    ) -> None:
        link.progress = [0]
        try:
            wire.send_all(link.sock, payload, deadline, link.progress)
        except wire.WireShort as short:
            if short.timed_out:
                err: TransferError = self._timeout_error(batch, seq, nbytes, limit)
            else:
                offset = max(0, short.offset - wire.FRAME.size)
                err = self._lost(
                    link, f"at byte {offset} of {nbytes} of broadcast #{seq}", short.cause
                )
            batch.done(link.rank, err)
            self._fail(err)  # wake the other senders at once
        else:
            batch.done(link.rank, None)

    def _timeout_error(self, batch: _Batch, seq: int, nbytes: int, limit: float) -> TransferTimeout:
        with batch.cv:
            pending = sorted(batch.pending)
        behind = [
            f"{link} at byte {max(0, link.progress[0] - wire.FRAME.size)}"
            for link in self._links
            if link.rank in pending
        ]
        return TransferTimeout(
            f"TCP broadcast #{seq} of {nbytes} bytes did not reach every receiver "
            f"within {limit:g} s; "
            f"still sending to: {', '.join(behind) or 'none'} (receiver stalled or too slow)"
        )

    def _root_warmup(self, deadline: float, limit: float) -> None:
        waiting = {link.sock: link for link in self._links}
        with selectors.DefaultSelector() as sel:
            for sock, link in waiting.items():
                sel.register(sock, selectors.EVENT_READ, link)
            while waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = ", ".join(
                        str(link) for link in sorted(waiting.values(), key=lambda x: x.rank)
                    )
                    raise self._fail(
                        TransferTimeout(f"TCP warm-up: no ready from {missing} within {limit:g} s")
                    )
                for key, _ in sel.select(remaining):
                    link = key.data
                    length = self._expect(link, wire.TAG_READY, deadline, limit, "warm-up")
                    self.hellos[link.rank] = self._read_hello(link, length, deadline, limit)
                    sel.unregister(link.sock)
                    del waiting[link.sock]
        for link in self._links:
            self._send(link, [wire.frame(wire.TAG_GO)], deadline, "warm-up (go)")

    def _read_hello(self, link: PeerLink, length: int, deadline: float, limit: float) -> bytes:
        if length > wire.MAX_HELLO_BYTES:
            raise self._fail(
                TransferError(
                    f"TCP warm-up: {link} sent a {length}-byte hello, over the "
                    f"{wire.MAX_HELLO_BYTES}-byte bound"
                )
            )
        return self._read_payload(link, length, deadline, limit, "its warm-up hello")

    def _read_payload(
        self, link: PeerLink, length: int, deadline: float, limit: float, what: str
    ) -> bytes:
        buf = bytearray(length)
        try:
            wire.recv_into(link.sock, memoryview(buf), deadline)
        except wire.WireShort as short:
            raise self._short(
                link,
                short,
                f"TCP: {what} from {link} stalled after {limit:g} s",
                f"at byte {short.offset} of {length} of {what}",
            ) from None
        return bytes(buf)

    # -- one receiver's frames (sliced rounds) ------------------------------------------

    def send_frame(self, rank: int, parts: list[Any], *, seq: int, timeout: float | None) -> int:
        """Root: one ``WWSL`` frame (``parts`` back to back) on receiver ``rank``'s link
        only; returns the payload's bytes. Any failure aborts the communicator."""
        views = wire.byte_views(parts, writable=False)
        nbytes = sum(len(v) for v in views)
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        link = next((lk for lk in self._links if lk.rank == rank), None)
        if link is None or self._rank != 0:
            raise ValueError(f"rank {rank} is not a receiver of this root communicator")
        self._enter()
        try:
            head = memoryview(wire.frame(wire.TAG_SLICE, seq, nbytes))
            self._send(link, [head, *views], deadline, f"sliced frame #{seq}")
        finally:
            self._leave()
        return nbytes

    def recv_frame(self, *, seq: int, max_bytes: int, timeout: float | None) -> bytes:
        """Receiver: the next ``WWSL`` frame's payload (its seq checked, at most
        ``max_bytes``)."""
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        link = self._links[0]
        self._enter()
        try:
            what = f"sliced frame #{seq}"
            length = self._expect(link, wire.TAG_SLICE, deadline, limit, what, seq=seq)
            if length > max_bytes:
                raise self._fail(
                    TransferError(
                        f"TCP {what} from {link} is {length} bytes, over the {max_bytes} this "
                        "round can hold: the two sides disagree on the round's tensors"
                    )
                )
            return self._read_payload(link, length, deadline, limit, what)
        finally:
            self._leave()

    def _limit(self, timeout: float | None) -> float:
        if timeout is None:
            return self._transfer_timeout
        return wire.positive_seconds("timeout", timeout)

    # -- receiver --------------------------------------------------------------------

    def _recv_broadcast(
        self, views: list[wire.ByteView], nbytes: int, seq: int, deadline: float, limit: float
    ) -> None:
        link = self._links[0]
        length = self._expect(
            link, wire.TAG_BROADCAST, deadline, limit, f"broadcast #{seq}", seq=seq
        )
        if length != nbytes:
            raise self._fail(
                TransferError(
                    f"TCP stream desynchronized at broadcast #{seq}: "
                    f"this receiver expected {nbytes} bytes, the sender sent {length}; "
                    "the two sides disagree on the framing plan (update info or buffer size)"
                )
            )
        progress = [0]
        try:
            for view in views:
                wire.recv_into(link.sock, view, deadline, progress)
        except wire.WireShort as short:
            where = f"at byte {short.offset} of {nbytes} of broadcast #{seq}"
            stalled = f"TCP receive from {link} stalled {where} after {limit:g} s"
            raise self._short(link, short, stalled, where) from None


def root_communicator(
    links: list[tuple[int, socket.socket, str]],
    world_size: int,
    *,
    transfer_timeout: float | None,
    warmup_timeout: float | None,
) -> TCPCommunicator:
    """Rank 0's communicator over the authenticated connections.

    Used by ``TCPRendezvous.accept``.
    """
    return TCPCommunicator(
        rank=0,
        world_size=world_size,
        links=[PeerLink(r, s, a) for r, s, a in sorted(links, key=lambda x: x[0])],
        transfer_timeout=transfer_timeout,
        warmup_timeout=warmup_timeout,
    )


def _unread(sock: socket.socket) -> int:
    """The bytes queued for reading on ``sock`` (Linux ``FIONREAD`` / ``SIOCINQ``)."""
    raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", raw)[0])
