"""The worker's end of ``weightwire_tcp``: dial the trainer, prove the secret, receive.

``connect_tcp`` is the registry's ``connect`` for the backend (``weightwire.backends``);
``TCPLink`` receives a round's chunks on a background thread so the socket read
overlaps ``load_weights``. With several broadcasting trainer ranks each one is the root
of its own TCP star: the link holds one connection per ``src`` and receives a turn on
its broadcaster's.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from weightwire.backends.receiving import ChunkedLink
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.slices import parse_frame
from weightwire.backends.worker_base import ReceiveProgress, ReceiveTurn
from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box
from weightwire.shared.staging import round_bytes
from weightwire.shared.timeouts import Timeouts

log = logging.getLogger(__name__)

# Extra seconds a pipelined wait allows beyond the communicator's own per-broadcast
# timeout, so the communicator's clearer TransferTimeout wins the race.
_WAIT_SLACK_S = 5.0
# A sliced update's frames carry at most the round's bytes plus their piece headers.
_FRAME_SLACK_BYTES = 16 << 20


def connect_tcp(
    info: TCPInitInfo, *, rank: int, device: torch.device, hello: bytes = b""
) -> TCPLink:
    """Dial the trainer at ``info.host:info.port`` as ``rank``, prove the secret, warm up.

    Rendezvous and warm-up are bounded by this worker's own ``Timeouts``; the init
    info's ``timeout_s`` bounds each transfer. A handshake the sender dropped before
    its verdict (it sheds idle connections when flooded) is retried until
    ``connect_s`` runs out; a refusal (wrong secret, rank, size) is not. ``hello`` (the
    wants' JSON, when the init info asked for them) rides on the warm-up ready to rank 0.
    """
    local = Timeouts.from_env()
    deadline = time.monotonic() + local.connect_s
    # Each broadcaster is the root of its own star: with one it is the whole group; with
    # several, the worker's star rank skips the other trainer ranks (not rank_offset: a
    # later data-parallel server's workers start past the earlier servers' ones).
    star_rank = rank - info.broadcasters + 1
    star_world = info.world_size - info.broadcasters + 1
    comms: list[TCPCommunicator] = []
    try:
        for src, (host, port, secret) in enumerate(info.endpoints):
            while True:
                try:
                    comm = TCPCommunicator.connect(
                        host=host,
                        port=port,
                        secret=secret,
                        rank=star_rank,
                        world_size=star_world,
                        timeout=max(0.001, deadline - time.monotonic()),
                    )
                    break
                except PeerLost as exc:
                    if time.monotonic() >= deadline:
                        raise
                    log.info(
                        "rank %d: TCP sender src %d dropped the handshake (%s); retrying",
                        rank,
                        src,
                        exc,
                    )
                    time.sleep(0.05)  # a sender that drops at once (closing) must not be spun on
            comms.append(comm)
            comm.warmup(timeout=local.warmup_s, hello=hello if src == 0 else b"")
    except BaseException:
        for comm in comms:
            comm.abort()
        raise
    return TCPLink(comms, device=device, timeout_s=info.timeout_s, depth=info.packed_num_buffers)


@dataclass(frozen=True)
class _Posted:
    """A chunk whose receive is queued on the link's thread."""

    future: cf.Future[None]
    host: torch.Tensor
    nbytes: int


class TCPLink(ChunkedLink):
    """TCP data plane: one background thread receives chunks in order.

    The socket read runs off the caller's thread so that it overlaps ``load_weights``
    (both release the GIL). On a CUDA worker bytes land in pinned host staging
    buffers (reused round-robin: each is free again once its chunk was copied to
    the device) and are copied to a fresh device buffer.

    ``comms``: one connection per broadcasting trainer rank (``src``), each its star's
    rank-0 link. Any error aborts all of them: a half-read stream from one broadcaster
    makes the whole round unusable.
    """

    def __init__(
        self,
        comms: Sequence[TCPCommunicator],
        *,
        device: torch.device,
        timeout_s: float,
        depth: int,
    ) -> None:
        super().__init__(device=device, timeout_s=timeout_s, depth=depth, sources=len(comms))
        self.comms = list(comms)
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightwire-tcp-recv")
        self._pending: dict[int, _Posted] = {}
        self._staging: list[torch.Tensor | None] = [None] * self.depth

    def _host_buffer(self, index: int, nbytes: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.empty(nbytes, dtype=torch.uint8)
        slot = index % self.depth
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._staging[slot] = buf
        return buf

    def post(self, index: int, turn: ReceiveTurn) -> None:
        nbytes = turn.chunks[index].nbytes
        host = self._host_buffer(index, nbytes)
        view = host.numpy()[:nbytes]
        comm = self.comms[turn.src]
        try:
            future = self._pool.submit(comm.broadcast, view, root=0, timeout=self.timeout_s)
        except RuntimeError:  # the pool is shut down: abort() ran, possibly from another thread
            raise TransferError(
                f"TCP receive link was aborted before chunk {index} was posted"
            ) from None
        self._pending[index] = _Posted(future, host, nbytes)

    def wait(self, index: int) -> torch.Tensor:
        posted = self._pending.pop(index)
        try:
            posted.future.result(timeout=self.timeout_s + _WAIT_SLACK_S)
        except cf.TimeoutError:
            raise TransferTimeout(
                f"TCP receive of chunk {index} exceeded {self.timeout_s:.0f}s"
            ) from None
        host = posted.host[: posted.nbytes]
        if self.device.type == "cpu":
            return host
        out = torch.empty(posted.nbytes, dtype=torch.uint8, device=self.device)
        out.copy_(host)  # synchronous: the staging slot is free after this
        return out

    def receive_sliced(
        self, metas: Sequence[ParamMeta], progress: ReceiveProgress
    ) -> Iterator[tuple[int, Box, torch.Tensor]]:
        """Every sender's frames until each one's last: one sender (rank 0), or with several
        trainer processes each on its own star, read a frame of each in turn (none of them
        waits on its socket for the whole of another's part); each piece's bytes as a view
        of its frame (on this worker's device). The caller checks the union (``Cover``)."""
        bound = round_bytes(metas) + _FRAME_SLACK_BYTES
        seqs = [0] * len(self.comms)
        open_ = list(range(len(self.comms)))
        frames = 0
        while open_:
            for src in list(open_):
                comm = self.comms[src]
                where = f"TCP sliced round from {comm!r}"
                progress.chunk = frames
                try:
                    payload = bytearray(
                        comm.recv_frame(seq=seqs[src], max_bytes=bound, timeout=self.timeout_s)
                    )
                except TransferError as exc:
                    if len(self.comms) == 1:
                        raise
                    # each star's root is its "rank 0": name the trainer sender instead
                    raise type(exc)(
                        f"trainer sender src {src} of {len(self.comms)}: {exc}"
                    ) from exc
                pieces, last = parse_frame(payload, metas, where)
                got = sum(p.nbytes for p in pieces)
                bound -= got
                progress.nbytes += got
                frame = torch.frombuffer(payload, dtype=torch.uint8) if payload else None
                if frame is not None and self.device.type != "cpu":
                    frame = frame.to(self.device)
                for p in pieces:
                    assert frame is not None
                    yield p.tensor, p.box, frame[p.offset : p.offset + p.nbytes]
                seqs[src] += 1
                frames += 1
                if last:
                    open_.remove(src)
        progress.chunk = max(0, frames - 1)

    def peer_closed(self) -> bool:
        """Every broadcaster closed its connection (TCP tells without traffic)."""
        return all(comm.peer_closed() for comm in self.comms)

    def bytes_unread(self) -> bool:
        """A broadcaster's bytes wait unread (``TCPCommunicator.bytes_unread``)."""
        return any(comm.bytes_unread() for comm in self.comms)

    def _stop(self) -> None:
        for posted in self._pending.values():
            posted.future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def abort(self) -> None:
        try:
            for comm in self.comms:  # unblocks a recv in flight on the link's thread
                comm.abort()
        finally:
            self._stop()

    def close(self) -> None:
        try:
            for comm in self.comms:
                comm.close()
        finally:
            self._stop()
