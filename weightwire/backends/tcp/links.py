"""A TCP rank's authenticated connections and the failure rule they share.

``LinkGroup`` is the part of ``comm.TCPCommunicator`` that is about its sockets, not about
what it broadcasts: one warmup/broadcast at a time, the first failure wins and aborts every
socket at once, a torn-down group never closes an fd another thread is still inside, and one
framed send or header read on a link with the error that names the peer.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Sequence
from typing import Any

from weightwire.backends.tcp import wire
from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout


class PeerLink:
    """One connection to a peer; on the root, optionally served by a persistent sender thread."""

    def __init__(self, rank: int, sock: socket.socket, addr: str) -> None:
        self.rank = rank
        self.sock = sock
        self.addr = addr
        self.progress = [0]
        self.jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.addr})"


class LinkGroup:
    """One rank's links to its peers (rank 0: every receiver; a receiver: rank 0)."""

    def __init__(self, *, rank: int, world_size: int, links: list[PeerLink]) -> None:
        self._rank = rank
        self._world_size = world_size
        self._links = links
        self._lock = threading.Lock()
        self._busy = threading.Lock()  # one warmup/broadcast at a time: frames must not interleave
        self._state = "open"
        self._active = 0
        self._fds_closed = False
        self._failure: TransferError | None = None

    def abort(self) -> None:
        """Shut every socket down at once (waking blocked threads); later calls raise."""
        self._teardown("aborted")

    def close(self) -> None:
        self._teardown("closed")

    def _send(
        self,
        link: PeerLink,
        chunks: Sequence[bytes | wire.ByteView],
        deadline: float,
        what: str,
    ) -> None:
        views = [memoryview(c) if isinstance(c, bytes) else c for c in chunks]
        try:
            wire.send_all(link.sock, views, deadline, [0])
        except wire.WireShort as short:
            raise self._short(
                link, short, f"TCP {what}: sending to {link} timed out", f"during {what}"
            ) from None

    def _expect(
        self,
        link: PeerLink,
        tag: bytes,
        deadline: float,
        limit: float,
        what: str,
        *,
        seq: int | None = None,
    ) -> int:
        """Read one frame header from ``link``; check its tag (and seq); return its length."""
        try:
            got_tag, got_seq, length = wire.FRAME.unpack(
                wire.recv_exact(link.sock, wire.FRAME.size, deadline)
            )
        except wire.WireShort as short:
            raise self._short(
                link,
                short,
                f"TCP {what}: nothing from {link} within {limit:g} s",
                f"before {what} (header byte {short.offset} of {wire.FRAME.size})",
            ) from None
        if got_tag != tag:
            raise self._fail(
                TransferError(
                    f"TCP stream desynchronized during {what}: "
                    f"expected frame {tag!r} from {link}, got {got_tag!r}"
                )
            )
        if seq is not None and got_seq != seq:
            raise self._fail(
                TransferError(
                    "TCP stream desynchronized: "
                    f"expected broadcast #{seq} from {link}, got #{got_seq}"
                )
            )
        return length

    def _short(
        self, link: PeerLink, short: wire.WireShort, stalled: str, where: str
    ) -> TransferError:
        """What a short send / receive on ``link`` fails the group with: ``stalled`` when its
        deadline passed, else the link lost ``where``."""
        if short.timed_out:
            return self._fail(TransferTimeout(stalled))
        return self._fail(self._lost(link, where, short.cause))

    def _lost(self, link: PeerLink, where: str, cause: str) -> TransferError:
        if self._state != "open":
            return TransferError(
                f"TCP communicator (rank {self._rank}) was {self._state} {where} with {link}"
            )
        return PeerLost(f"lost {link} {where}: {cause}")

    def _enter(self) -> None:
        with self._lock:
            if self._state != "open":
                reason = f": {self._failure}" if self._failure is not None else ""
                raise TransferError(
                    f"TCP communicator (rank {self._rank}) is {self._state}{reason}"
                )
            if not self._busy.acquire(blocking=False):
                raise RuntimeError(
                    "TCPCommunicator: warmup/broadcast called while another is in progress; "
                    "calls must be sequential"
                )
            self._active += 1

    def _leave(self) -> None:
        self._busy.release()
        self._exit()

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1
            close_now = self._state != "open" and self._active == 0 and not self._fds_closed
            self._fds_closed |= close_now
        if close_now:
            self._close_fds()

    def _fail(self, error: TransferError) -> TransferError:
        with self._lock:
            if self._failure is None:
                self._failure = error
            first = self._failure
        self.abort()
        return first

    def _teardown(self, state: str) -> None:
        with self._lock:
            if self._state == "open":
                self._state = state
            if not self._fds_closed:
                for link in self._links:
                    wire.shutdown_quietly(link.sock)
            # Never close an fd another thread may still be inside: the last _exit closes them.
            close_now = self._active == 0 and not self._fds_closed
            self._fds_closed |= close_now
        for link in self._links[1:] if self._rank == 0 else ():
            link.jobs.put(None)
        if close_now:
            self._close_fds()

    def _close_fds(self) -> None:
        for link in self._links:
            link.sock.close()
