"""The worker's end of ``weightwire_tcp``: dial the trainer, prove the secret, receive.

``connect_tcp`` is the registry's ``connect`` for the backend (``weightwire.backends``);
``TCPLink`` receives a round's chunks on a background thread so the socket read
overlaps ``load_weights``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.shared.communicator import PeerLost, TransferError, TransferTimeout
from weightwire.shared.framing import Chunk
from weightwire.shared.info import TCPInitInfo
from weightwire.shared.meta import ParamMeta
from weightwire.shared.timeouts import Timeouts
from weightwire.torch_side.worker.receive import ReceiveLink
from weightwire.torch_side.worker.sources import MultiSourceLink

log = logging.getLogger(__name__)

# Extra seconds a pipelined wait allows beyond the communicator's own per-broadcast
# timeout, so the communicator's clearer TransferTimeout wins the race.
_WAIT_SLACK_S = 5.0


def connect_tcp(info: TCPInitInfo, *, rank: int, device: torch.device) -> ReceiveLink:
    """Dial the trainer at ``info.host:info.port`` as ``rank``, prove the secret, warm up.

    Rendezvous and warm-up are bounded by this worker's own ``Timeouts``; the init
    info's ``timeout_s`` bounds each transfer. A handshake the sender dropped before
    its verdict (it sheds idle connections when flooded) is retried until
    ``connect_s`` runs out; a refusal (wrong secret, rank, size) is not.
    """
    local = Timeouts.from_env()
    deadline = time.monotonic() + local.connect_s
    # Each broadcaster is the root of its own star: with one it is the whole group; with
    # several, the worker's star rank skips the other trainer ranks (not rank_offset: a
    # later data-parallel server's workers start past the earlier servers' ones).
    star_rank = rank - info.broadcasters + 1
    star_world = info.world_size - info.broadcasters + 1
    links: list[ReceiveLink] = []
    try:
        for src, (host, port, secret) in enumerate(info.endpoints):
            while True:
                try:
                    comm = TCPCommunicator.connect(
                        host=host, port=port, secret=secret, rank=star_rank,
                        world_size=star_world, timeout=max(0.001, deadline - time.monotonic()),
                    )
                    break
                except PeerLost as exc:
                    if time.monotonic() >= deadline:
                        raise
                    log.info("rank %d: TCP sender src %d dropped the handshake (%s); retrying", rank, src, exc)
                    time.sleep(0.05)  # a sender that drops at once (closing) must not be spun on
            try:
                comm.warmup(timeout=local.warmup_s)
            except BaseException:
                comm.abort()
                raise
            links.append(TCPLink(comm, device=device, timeout_s=info.timeout_s, depth=info.packed_num_buffers))
    except BaseException:
        for link in links:
            link.abort()
        raise
    return links[0] if len(links) == 1 else MultiSourceLink(links)


class TCPLink(ReceiveLink):
    """TCP data plane: one background thread receives chunks in order.

    The socket read runs off the caller's thread so that it overlaps ``load_weights``
    (both release the GIL). On a CUDA worker bytes land in pinned host staging
    buffers (reused round-robin: each is free again once its chunk was copied to
    the device) and are copied to a fresh device buffer.
    """

    def __init__(self, communicator: Any, *, device: torch.device, timeout_s: float, depth: int) -> None:
        super().__init__(communicator, device=device, timeout_s=timeout_s, depth=depth)
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightwire-tcp-recv")
        self._pending: dict[int, tuple[cf.Future[None], torch.Tensor, int]] = {}
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

    def post(self, index: int, chunk: Chunk, metas: Sequence[ParamMeta], *, packed: bool) -> None:
        host = self._host_buffer(index, chunk.nbytes)
        view = host.numpy()[: chunk.nbytes]
        try:
            future = self._pool.submit(self.communicator.broadcast, view, root=0, timeout=self.timeout_s)
        except RuntimeError:  # the pool is shut down: abort() ran, possibly from another thread
            raise TransferError(f"TCP receive link was aborted before chunk {index} was posted") from None
        self._pending[index] = (future, host, chunk.nbytes)

    def wait(self, index: int) -> torch.Tensor:
        future, host, nbytes = self._pending.pop(index)
        try:
            future.result(timeout=self.timeout_s + _WAIT_SLACK_S)
        except cf.TimeoutError:
            raise TransferTimeout(f"TCP receive of chunk {index} exceeded {self.timeout_s:.0f}s") from None
        if self.device.type == "cpu":
            return host[:nbytes]
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        out.copy_(host[:nbytes])  # synchronous: the staging slot is free after this
        return out

    def _stop(self) -> None:
        for future, _, _ in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def abort(self) -> None:
        try:
            super().abort()  # unblocks a recv in flight on the worker thread
        finally:
            self._stop()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stop()
