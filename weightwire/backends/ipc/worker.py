"""The worker's end of ``weightwire_ipc``: connect (say which modes this worker takes,
learn the session's), then ``IPCPullLink`` (pull mode) or ``IPCLink`` (push mode).

Pull (packed rounds, the default): each chunk lands in a buffer of this worker's
``ReceivePool`` (exported once, reused every round); ``post`` names it to the trainer
("want", after recording the buffer's free event on torch's current stream), the
trainer copies the chunk's tensors straight into it and says "ready"; ``wait`` makes
the current stream wait on the ready event and hands the buffer to torch as a lease
(``pool.ReceivePool.lease``): no copy on this side.

Push, per piece (the trainer's slots opened once per session): the copy stream waits (on
the device) for the slot's ready event, copies the piece into the chunk's fresh buffer,
records this worker's free event for the slot and only then says "free" to the trainer,
which refills the slot after that event. The copy-out is needed: vLLM's layerwise reload
and ``HFModelHost`` keep the tensors they are handed until their layer (round) completes,
while the slot is refilled at once. Chunks land in fresh allocations, as on the other links.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

from weightwire.backends.ipc.channel import Channel, check_int, dial
from weightwire.backends.ipc.pool import ReceivePool
from weightwire.backends.ipc.slots import (
    MEMCPY_DEVICE_TO_DEVICE,
    OpenedSlots,
    cupy_module,
    device_uuid,
    dump_trace,
    event_handle,
    new_ipc_event,
    open_event,
    record,
    stream_wait,
    sync_stream,
    trace,
    wait_event_host,
    wait_mode,
)
from weightwire.backends.receiving import ChunkedLink
from weightwire.backends.worker_base import ReceiveTurn, Unpacker, WorkerPairs
from weightwire.shared.errors import TransferError
from weightwire.shared.framing import Chunk
from weightwire.shared.info import encode_secret
from weightwire.shared.ipc_info import IPC_MODES, IPCInitInfo, decode_handles
from weightwire.shared.timeouts import Timeouts


class IPCReceiver:
    """A worker's session: channel, opened slots and ready events, its own free events."""

    def __init__(
        self,
        cp: Any,
        device: int,
        channel: Channel,
        slots: OpenedSlots,
        ready: list[int],
        free: list[int],
        info: IPCInitInfo,
    ) -> None:
        self.cp, self.device, self.channel, self.slots = cp, device, channel, slots
        self.ready, self.free, self.info = ready, free, info
        self._state = "open"

    @property
    def same_gpu(self) -> bool:
        return bool(self.info.device_uuid) and self.info.device_uuid == device_uuid(
            self.cp, self.device
        )

    def alive(self) -> None:
        if self._state != "open":
            raise TransferError(
                f"IPC receive link is {self._state}; call init_weight_transfer_engine again"
            )

    def warmup(self, *, timeout: float) -> None:
        self.channel.expect(
            "ping",
            deadline=time.monotonic() + timeout,
            what="the trainer's warm-up",
            alive=self.alive,
        )
        self.channel.send({"op": "pong"})

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
        self.channel.abort()
        # Mappings stay until close: a copy-out may still be reading them.

    def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self.channel.close()
        self.slots.close()
        for e in self.free:
            with suppress(Exception):
                self.cp.cuda.runtime.eventDestroy(e)
        self.free = []


def connect_ipc(
    info: IPCInitInfo,
    *,
    rank: int,
    device: torch.device,
    through: Callable[..., IPCPullLink] | None = None,
) -> IPCLink | IPCPullLink:
    """Dial the trainer's channel, say hello (with the modes this worker takes), learn the
    session's mode, open the trainer's events (and, in push mode, its slots), warm up.
    ``through``: the write-through link's class (``ipc.through.worker``), offered when given."""
    if device.type != "cuda":
        raise ValueError(f"weightwire_ipc needs a CUDA worker device, got {device}")
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
    try:
        channel = dial(
            info.host,
            info.port,
            info.secret,
            timeout=local.connect_s,
            peer=f"the IPC trainer at {info.host}:{info.port}",
        )
    except BaseException:
        for e in free:
            with suppress(Exception):
                cp.cuda.runtime.eventDestroy(e)
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
class _Posted:
    """A posted chunk: the buffer it lands in (``None``: an empty chunk, pull mode)."""

    buffer: Any
    chunk: Chunk
    last: bool
    """The round's last chunk: its end closes what the session releases after a round."""


@dataclass(frozen=True)
class _Early:
    """A pool buffer named to the trainer at the round's start, for one chunk."""

    buffer: Any
    nbytes: int
    """The size it was named for (the last update's size of that chunk)."""


def _posted(buffer: Any, index: int, turn: ReceiveTurn) -> _Posted:
    chunk = turn.chunks[index]
    return _Posted(buffer, chunk, chunk.stop == len(turn.metas))


class IPCLink(ChunkedLink):
    """Chunks arrive as pieces through the trainer's slots (see the module docstring)."""

    def __init__(
        self, communicator: IPCReceiver, *, device: torch.device, timeout_s: float, depth: int
    ) -> None:
        super().__init__(device=device, timeout_s=timeout_s, depth=depth)
        self.communicator = communicator
        self._stream = torch.cuda.Stream(device=device)
        self._pending: dict[int, _Posted] = {}
        self._host_wait = wait_mode() == "host"

    def post(self, index: int, turn: ReceiveTurn) -> None:
        buf = torch.empty(turn.chunks[index].nbytes, dtype=torch.uint8, device=self.device)
        # The fresh block may have been freed by work still queued on the current stream.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._pending[index] = _posted(buf, index, turn)

    def wait(self, index: int) -> torch.Tensor:
        posted = self._pending.pop(index)
        buf, chunk, last = posted.buffer, posted.chunk, posted.last
        rx = self.communicator
        cp, ch, sptr = rx.cp, rx.channel, self._stream.cuda_stream
        deadline = time.monotonic() + self.timeout_s
        got, base, count = 0, buf.data_ptr(), len(rx.ready)
        with cp.cuda.Device(rx.device):
            while got < chunk.nbytes:
                trace(f"wait c{index}")
                msg = ch.recv(
                    deadline=deadline, what=f"piece at byte {got} of chunk {index}", alive=rx.alive
                )
                trace(f"got {msg.get('s')}")
                if msg["op"] == "slots":
                    self._remap(msg)
                    continue
                if msg["op"] != "ready":
                    raise TransferError(
                        f"{ch.peer} sent {msg['op']!r} while chunk {index} was being received"
                    )
                if (
                    check_int(msg, "c", 0, 1 << 62, ch.peer) != index
                    or check_int(msg, "o", 0, 1 << 62, ch.peer) != got
                ):
                    raise TransferError(
                        f"{ch.peer} announced chunk {msg['c']} at byte {msg['o']} "
                        f"where chunk {index} at byte {got} "
                        "was due: trainer and worker disagree on the round's plan"
                    )
                slot = check_int(msg, "s", 0, count - 1, ch.peer)
                n = check_int(
                    msg, "n", 1, min(chunk.nbytes - got, rx.info.packed_buffer_size_bytes), ch.peer
                )
                if self._host_wait:
                    wait_event_host(
                        cp,
                        rx.ready[slot],
                        deadline=deadline,
                        what=f"the trainer's fill of IPC slot {slot}",
                        alive=rx.alive,
                    )
                else:
                    stream_wait(cp, sptr, rx.ready[slot])
                cp.cuda.runtime.memcpyAsync(
                    base + got, rx.slots.ptrs[slot], n, MEMCPY_DEVICE_TO_DEVICE, sptr
                )
                record(cp, rx.free[slot], sptr)
                ch.send({"op": "free", "s": slot})
                got += n
            if last and rx.info.release_after_round:
                # The trainer frees its slots after this round: copy-outs done, mappings closed
                # first.
                sync_stream(
                    cp,
                    rx.device,
                    sptr,
                    timeout=self.timeout_s,
                    what="the IPC copy-out",
                    alive=rx.alive,
                )
                rx.slots.close()
                ch.send({"op": "closed"})
        buf.record_stream(self._stream)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if last:
            dump_trace("worker")
        return buf

    def _remap(self, msg: dict[str, Any]) -> None:
        rx = self.communicator
        handles = decode_handles(f"{rx.channel.peer} slots.mem", msg.get("mem"))
        if len(handles) != len(rx.ready):
            raise TransferError(
                f"{rx.channel.peer} announced {len(handles)} slots, the session has {len(rx.ready)}"
            )
        rx.slots.open(handles)

    def _settle(self, timeout: float) -> bool:
        rx = self.communicator
        try:
            sync_stream(
                rx.cp,
                rx.device,
                self._stream.cuda_stream,
                timeout=timeout,
                what="the IPC copy stream",
            )
        except Exception:
            return False
        return True

    def abort(self) -> None:
        self._pending.clear()
        self.communicator.abort()
        # Unmap once no copy-out reads the slots any more (bounded); a copy stream
        # that will not settle keeps its mappings rather than read unmapped memory.
        if self._settle(5.0):
            self.communicator.close()

    def close(self) -> None:
        self._pending.clear()
        if self._settle(30.0):
            self.communicator.close()
        else:
            self.communicator.abort()


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
        self._pending: dict[int, _Posted] = {}
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
                self._pending[index] = _posted(named.buffer, index, turn)
                return
            self.pool.unfill(named.buffer)  # the plan changed: the trainer skips it too
        if chunk.nbytes == 0:  # nothing to write (a round of empty tensors)
            self._pending[index] = _posted(None, index, turn)
            return
        buf = self.pool.acquire(chunk.nbytes, self._stream())
        self._pending[index] = _posted(buf, index, turn)
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
