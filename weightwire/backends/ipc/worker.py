"""The worker's end of ``weightwire_ipc``: connect (say which modes this worker takes,
learn the session's), then ``IPCPullLink`` (pull mode) or ``push.worker.IPCLink`` (push
mode).

Pull (packed rounds, the default): each chunk lands in a buffer of this worker's
``ReceivePool`` (exported once, reused every round); ``post`` names it to the trainer
("want", after recording the buffer's free event on torch's current stream), the
trainer copies the chunk's tensors straight into it and says "ready"; ``wait`` makes
the current stream wait on the ready event and hands the buffer to torch as a lease
(``pool.ReceivePool.lease``): no copy on this side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from weightwire._trace import dump_trace, trace
from weightwire.backends.ipc.channel import check_int, dial
from weightwire.backends.ipc.info import IPC_MODES, IPCInitInfo
from weightwire.backends.ipc.pool import ReceivePool
from weightwire.backends.ipc.push.worker import IPCLink
from weightwire.backends.ipc.receiver import IPCReceiver, Posted, posted_chunk
from weightwire.backends.ipc.slots import (
    OpenedSlots,
    cupy_module,
    destroy_events,
    device_uuid,
    event_handle,
    new_ipc_event,
    open_event,
    stream_wait,
    wait_event_host,
    wait_mode,
)
from weightwire.backends.receiving import ChunkedLink
from weightwire.backends.worker_base import LandingRecord, ReceiveTurn, Unpacker, WorkerPairs
from weightwire.shared.errors import TransferError
from weightwire.shared.info import encode_secret
from weightwire.shared.timeouts import Timeouts

log = logging.getLogger(__name__)


def connect_ipc(
    info: IPCInitInfo,
    *,
    rank: int,
    device: torch.device,
    through: Callable[..., IPCPullLink] | None = None,
    landing: Callable[[], LandingRecord] | None = None,
) -> IPCLink | IPCPullLink:
    """Dial the trainer's channel, say hello (with the modes this worker takes), learn the
    session's mode, open the trainer's events (and, in push mode, its slots), warm up.
    ``through``: the write-through link's class (``ipc.through.worker``), offered when given.
    ``landing``: the model's landing map for its served tensors, or why there is none
    (``worker_base.Connect``); a refusal goes in the hello (``cannot_write_through``), so
    a trainer asking ``auto`` pulls from the start."""
    if device.type != "cuda":
        raise ValueError(f"weightwire_ipc needs a CUDA worker device, got {device}")
    cannot = None
    if through is not None and info.packed and landing is not None:
        cannot = landing().refused
        if cannot is not None:
            log.info("weightwire_ipc: the model cannot be written through: %s", cannot)
    cp = cupy_module()
    index = device.index if device.index is not None else torch.cuda.current_device()
    local = Timeouts.from_env()
    with cp.cuda.Device(index):
        ready = [
            open_event(cp, h, f"the trainer's ready event {s}")
            for s, h in enumerate(info.event_handles)
        ]
        free = [new_ipc_event(cp) for _ in range(info.packed_num_buffers)]
        modes = ["pull", "push"] if info.packed else ["push"]
        if through is not None and info.packed:
            modes.insert(0, "write_through")
        hello = {
            "op": "hello",
            "rank": rank,
            "free": [encode_secret(event_handle(cp, e)) for e in free],
            "uuid": device_uuid(cp, index),
            "modes": modes,
        }
        if cannot is not None:
            # write-through stays offered: a trainer that asks for it explicitly gets it, and
            # this worker's rounds then go through its receive buffers (``ipc.through.worker``)
            hello["cannot_write_through"] = cannot[:500]
    try:
        channel = dial(
            info.host,
            info.port,
            info.secret,
            timeout=local.connect_s,
            peer=f"the IPC trainer at {info.host}:{info.port}",
        )
    except BaseException:
        destroy_events(cp, free)
        raise
    receiver = IPCReceiver(cp, index, channel, OpenedSlots(cp, index, []), ready, free, info)
    try:
        receiver.channel.send(hello)
        chosen = channel.expect(
            "mode",
            deadline=time.monotonic() + local.warmup_s,
            what="the session's mode",
            alive=receiver.alive,
        )
        mode, early = str(chosen.get("mode")), chosen.get("early")
        if mode not in IPC_MODES or mode not in modes:
            raise TransferError(
                f"{channel.peer} chose IPC mode {mode[:20]!r}, which this worker did not offer"
            )
        channel.expect(
            "ping",
            deadline=time.monotonic() + local.warmup_s,
            what="the trainer's warm-up",
            alive=receiver.alive,
        )
        if mode == "push":
            with cp.cuda.Device(index):
                receiver.slots.open(info.mem_handles)
        channel.send({"op": "pong"})
    except BaseException:
        receiver.abort()
        receiver.close()
        raise
    dev = torch.device("cuda", index)
    if mode == "write_through" and through is not None:
        return through(
            receiver, device=dev, timeout_s=info.timeout_s, depth=info.packed_num_buffers
        )
    if mode == "pull":  # a trainer that takes early wants says so in its mode message
        return IPCPullLink(
            receiver,
            device=dev,
            timeout_s=info.timeout_s,
            depth=info.packed_num_buffers,
            early=early is True,
        )
    return IPCLink(receiver, device=dev, timeout_s=info.timeout_s, depth=info.packed_num_buffers)


@dataclass(frozen=True)
class _Early:
    """A pool buffer named to the trainer at the round's start, for one chunk."""

    buffer: Any
    nbytes: int
    """The size it was named for (the last update's size of that chunk)."""


class IPCPullLink(ChunkedLink):
    """Chunks written by the trainer straight into this worker's pool (module docstring).

    Early wants (``early``, when the trainer offered them): at ``start_round`` (the
    round's start) the buffers for the first ``depth`` chunks are named at once, sized
    as the last update's chunks were, in one ``{"op": "early", "wants": [...]}``
    message, so the trainer can fill them while the update POST is still on its way
    here. ``post`` then takes chunk ``c``'s early buffer and sends no want when its size
    is the chunk's, and otherwise puts it back and names another (the trainer applies
    the same rule, so both always agree on which buffer holds which chunk). Only free
    buffers are named early (the pool never grows for it), and only between a start
    and the end of that round's update may the trainer write into them.
    """

    def __init__(
        self,
        communicator: IPCReceiver,
        *,
        device: torch.device,
        timeout_s: float,
        depth: int,
        early: bool = False,
    ) -> None:
        super().__init__(device=device, timeout_s=timeout_s, depth=depth)
        self.communicator = communicator
        self.pool = ReceivePool(communicator.cp, communicator.device)
        self._pending: dict[int, Posted] = {}
        self._host_wait = wait_mode() == "host"
        self._offer_early = early and not communicator.info.release_after_round
        self._early: dict[int, _Early] = {}  # by chunk index
        self._sizes: list[int] = []  # the last update's first ``depth`` chunk sizes

    def _stream(self) -> int:
        # The free event goes on torch's current stream: a reused buffer's last readers
        # (the previous round's loads) were ordered there, as the caching allocator assumes.
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def start_round(self) -> None:
        """Name the buffers of the coming update's first chunks (see the class docstring)."""
        if not self._offer_early or not self._sizes:
            return
        rx = self.communicator
        rx.alive()
        self._unfill_early()
        wants = []
        for c, n in enumerate(self._sizes):
            if n <= 0:
                continue
            buf = self.pool.acquire_free(n, self._stream())
            if buf is None:  # still leased (the model keeps last round's tensors): named on demand
                break
            self._early[c] = _Early(buf, n)
            wants.append({"c": c, "n": n, **self.pool.describe(buf)})
        trace(f"early {len(wants)} of {len(self._sizes)}")
        if wants:
            rx.channel.send({"op": "early", "wants": wants})

    def _unfill_early(self) -> None:
        early, self._early = self._early, {}
        for named in early.values():
            self.pool.unfill(named.buffer)

    def post(self, index: int, turn: ReceiveTurn) -> None:
        rx = self.communicator
        rx.alive()
        chunk = turn.chunks[index]
        if index == 0:
            self._sizes = []
        if index < self.depth:
            self._sizes.append(chunk.nbytes)
        trace(f"post c{index}")
        named = self._early.pop(index, None)
        if named is not None:
            if named.nbytes == chunk.nbytes:  # the trainer fills it without being asked
                self._pending[index] = posted_chunk(named.buffer, index, turn)
                return
            self.pool.unfill(named.buffer)  # the plan changed: the trainer skips it too
        if chunk.nbytes == 0:  # nothing to write (a round of empty tensors)
            self._pending[index] = posted_chunk(None, index, turn)
            return
        buf = self.pool.acquire(chunk.nbytes, self._stream())
        self._pending[index] = posted_chunk(buf, index, turn)
        rx.channel.send({"op": "want", "c": index, "n": chunk.nbytes, **self.pool.describe(buf)})

    def wait(self, index: int) -> torch.Tensor:
        posted = self._pending.pop(index)
        deadline = time.monotonic() + self.timeout_s
        if posted.buffer is None:
            out = torch.empty(0, dtype=torch.uint8, device=self.device)
        else:
            self._await_ready(index, deadline)
            lease = self.pool.lease(posted.buffer, posted.chunk.nbytes)
            out = torch.as_tensor(lease, device=self.device)
            trace(f"leased c{index}")
        self._round_tail(posted.last, deadline)
        return out

    def take(self, index: int, unpacker: Unpacker) -> WorkerPairs:
        """The chunk's views made *before* its ready message: the buffer is known since
        ``post``, and a plan that copies nothing out runs no device work, so the ~2 us per
        tensor of view making overlaps the trainer's fill instead of following it. Nothing
        reads the views before torch's stream waited on the ready event (``_await_ready``);
        the buffer stays ``filling`` until then (``ReceivePool.lease(ahead=True)``)."""
        posted = self._pending[index]
        if posted.buffer is None or not unpacker.in_place:
            return unpacker.unpack(self.wait(index))
        del self._pending[index]
        deadline = time.monotonic() + self.timeout_s
        lease = self.pool.lease(posted.buffer, posted.chunk.nbytes, ahead=True)
        pairs = unpacker.unpack(torch.as_tensor(lease, device=self.device))
        trace(f"views c{index}")
        self._await_ready(index, deadline)
        self.pool.filled(posted.buffer)
        self._round_tail(posted.last, deadline)
        return pairs

    def _await_ready(self, index: int, deadline: float) -> None:
        """Chunk ``index``'s ready message; then torch's current stream waits on its event."""
        rx = self.communicator
        cp, ch = rx.cp, rx.channel
        trace(f"wait c{index}")
        msg = ch.expect("ready", deadline=deadline, what=f"chunk {index}", alive=rx.alive)
        if check_int(msg, "c", 0, 1 << 62, ch.peer) != index:
            raise TransferError(
                f"{ch.peer} announced chunk {msg['c']} where chunk {index} was due: "
                "trainer and worker disagree on the round's plan"
            )
        event = rx.ready[check_int(msg, "e", 0, len(rx.ready) - 1, ch.peer)]
        with cp.cuda.Device(rx.device):
            if self._host_wait:
                wait_event_host(
                    cp,
                    event,
                    deadline=deadline,
                    what=f"the trainer's fill of chunk {index}",
                    alive=rx.alive,
                )
            else:
                stream_wait(cp, torch.cuda.current_stream(self.device).cuda_stream, event)

    def _round_tail(self, last: bool, deadline: float) -> None:
        if not last:
            return
        rx = self.communicator
        if rx.info.release_after_round:
            # The trainer closed its mappings of every buffer: the pool may be freed now.
            rx.channel.expect(
                "unmapped",
                deadline=deadline,
                what="the trainer's close of its mappings",
                alive=rx.alive,
            )
            self.pool.retire_all()
        self._unfill_early()  # named early for chunks this plan does not have: unused by both sides
        dump_trace("worker")

    def held_bytes(self) -> int:
        """Worker-side memory of the pool (raw ``cudaMalloc``: not in torch's counters)."""
        return self.pool.held_bytes()

    def abort(self) -> None:
        self._pending.clear()
        self.communicator.abort()
        self.pool.close()  # a buffer the trainer may still be writing stays allocated
        self.communicator.close()

    def close(self) -> None:
        self._pending.clear()
        self.pool.close()
        self.communicator.close()
