"""The two generic data paths a backend's ``sender`` may return (``base.RoundSender``).

Both are fed ``(Chunk, tensors)`` pairs in plan order:

- ``HostPipeline`` (host bytes over a ``Communicator``): the caller's thread turns
  chunk k+1 into host bytes while a sender thread broadcasts chunk k. At most
  ``num_buffers`` chunks exist as host bytes at once. A chunk goes out as its list of
  parts (one logical buffer, no concatenation copy).
- ``DevicePipeline`` (device buffers over a stream-ordered ``DeviceCommunicator``):
  chunk k is gathered into slot ``k % num_buffers``'s reusable device buffer
  (``SlotStore``, one device copy per tensor from the framework packer's regions) and
  broadcast on that slot's stream, so packing k+1 overlaps broadcasting k. The host
  waits only when a slot comes round again (for the chunk ``num_buffers`` back) and at
  the final drain; every wait goes through ``comm.synchronize`` with a timeout.

Both run ``begin`` once the first chunk is prepared and before its first byte goes
out, so the first chunk's packing overlaps the control plane's round trips.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from weightwire.backends.base import (
    DevicePacker,
    HostBytes,
    Outgoing,
    RoundAborted,
    RoundSender,
    SenderParts,
    SenderSettings,
    Sent,
    check_chunk_bytes,
    run_once,
)
from weightwire.shared.communicator import Communicator, DeviceCommunicator
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import TransferTimeout
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta


class HostPipeline(RoundSender):
    """Host-byte broadcasts with one chunk in preparation while another is sent."""

    def __init__(
        self,
        comm: Communicator,
        host_bytes: HostBytes,
        *,
        num_buffers: int,
        timeout: float,
        prefetch: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self._comm = comm
        self._host_bytes = host_bytes
        self._depth = max(1, num_buffers - 1)  # queued chunks; one more is on the wire
        self._timeout = timeout
        self._prefetch = prefetch

    def send(self, out: Outgoing) -> Sent:
        """Broadcast every chunk; returns ``(bytes, broadcasts)`` once all were sent."""
        prepared, stop, begin = out.prepared, out.stop, out.begin
        work: queue.Queue[list[np.ndarray] | None] = queue.Queue(maxsize=self._depth)
        failure: list[BaseException] = []
        thread = threading.Thread(
            target=self._sender,
            args=(work, stop, failure, out.root),
            name="weightwire-send",
            daemon=True,
        )
        thread.start()
        nbytes = count = 0
        try:
            for chunk, tensors in prepared:
                if self._prefetch is not None:
                    self._prefetch(tensors)
                parts = [self._host_bytes(t) for t in tensors]
                got = sum(p.nbytes for p in parts)
                check_chunk_bytes(chunk, got)
                begin = run_once(begin)
                self._put(work, parts, stop, failure)
                nbytes, count = nbytes + got, count + 1
            begin = run_once(begin)
            self._put(work, None, stop, failure)
            # Each queued broadcast is bounded by its own timeout; this only guards the thread.
            thread.join(self._timeout * (self._depth + 1) + 5.0)
            if thread.is_alive():
                raise TransferTimeout(
                    f"host sender did not drain within {self._timeout * (self._depth + 1):.0f} s"
                )
        except BaseException:
            stop.set()
            if failure:  # the sender's error is the cause; ours is a consequence
                raise failure[0] from None
            raise
        if failure:
            raise failure[0]
        return Sent(nbytes, count)

    def _put(
        self, work: queue.Queue, item: Any, stop: threading.Event, failure: list[BaseException]
    ) -> None:
        while True:
            if failure:
                raise failure[0]
            if stop.is_set():
                raise RoundAborted("round stopped while chunks were still queued")
            try:
                work.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def _sender(
        self, work: queue.Queue, stop: threading.Event, failure: list[BaseException], root: int
    ) -> None:
        try:
            while not stop.is_set():
                try:
                    parts = work.get(timeout=0.05)
                except queue.Empty:
                    continue
                if parts is None:
                    return
                self._comm.broadcast(parts, root=root, timeout=self._timeout)
        except BaseException as exc:
            failure.append(exc)
            stop.set()


def host_sender(link: Communicator, settings: SenderSettings, parts: SenderParts) -> HostPipeline:
    """A host-bytes backend's ``Backend.sender``: the generic host pipeline over ``link``, as
    deep as the session's ``packed_num_buffers``, each broadcast bounded by ``transfer_s``."""
    return HostPipeline(
        link,
        parts.host_bytes,
        num_buffers=settings.packed_num_buffers,
        timeout=settings.timeouts.transfer_s,
        prefetch=parts.prefetch,
    )


class SlotStore(Protocol):
    """One reusable device buffer per slot (``backends.device.SlotBuffers``)."""

    def gather(self, slot: int, parts: Sequence[Any], nbytes: int, stream: Any) -> Any: ...
    def slot(self, slot: int, nbytes: int) -> Any: ...
    def settled(self, slot: int) -> None: ...
    def release(self) -> None: ...


class DevicePipeline(RoundSender):
    """Device-buffer broadcasts on ``num_buffers`` rotating streams.

    Streams are created once per session: a caching allocator keys freed blocks by
    stream, so fresh streams every round would strand memory. Buffers in flight are
    held on ``self`` until their stream is known complete, also across an error (the
    caller aborts the communicator, which stops the kernels that read them).
    """

    def __init__(
        self,
        comm: DeviceCommunicator,
        packer: DevicePacker,
        slots: SlotStore,
        *,
        packed: bool,
        num_buffers: int,
        timeout: float,
        hold_bytes: int,
    ) -> None:
        self._comm = comm
        self._packer = packer
        self._slots = slots
        self._packed = packed
        self._timeout = timeout
        self._hold_bytes = hold_bytes
        self._streams = [packer.new_stream() for _ in range(num_buffers)]
        self._in_flight: list[list[Any]] = [[] for _ in range(num_buffers)]

    def _sync(self, slot: int) -> None:
        self._comm.synchronize(self._streams[slot], timeout=self._timeout)
        self._in_flight[slot].clear()
        self._slots.settled(slot)

    def settle(self) -> None:
        for slot in range(len(self._streams)):
            self._sync(slot)

    def close(self) -> None:
        self._in_flight = [[] for _ in self._streams]
        self._slots.release()

    def send(self, out: Outgoing) -> Sent:
        if self._packed:
            return self._send_packed(out)
        return self._send_unpacked(out)

    def _send_packed(self, out: Outgoing) -> Sent:
        n, begin = len(self._streams), out.begin
        nbytes = count = 0
        for k, (chunk, tensors) in enumerate(out.prepared):
            if out.stop.is_set():
                raise RoundAborted("round stopped between chunks")
            slot = k % n
            if self._in_flight[slot]:
                self._sync(slot)  # the chunk n back on this stream: its buffer may now be dropped
            stream = self._streams[slot]
            buf = self._slots.gather(
                slot, self._packer.regions(tensors, stream), chunk.nbytes, stream
            )
            self._in_flight[slot].append((buf, tensors))
            begin = run_once(begin)  # the control plane's round trips overlap the first pack
            self._comm.broadcast(buf, root=out.root, timeout=self._timeout, stream=stream)
            nbytes, count = nbytes + chunk.nbytes, count + 1
        run_once(begin)
        self.settle()
        return Sent(nbytes, count)

    def discard(
        self,
        chunks: Sequence[Chunk],
        metas: Sequence[ParamMeta],
        *,
        root: int,
        stop: threading.Event,
    ) -> None:
        """Receive another broadcaster's turn (``root``) and drop it: an NCCL broadcast is
        collective over the whole communicator, so a group member that skipped it would
        hang every other member. Same slot rotation and waits as a packed send."""
        n = len(self._streams)
        for k, chunk in enumerate(chunks):
            if stop.is_set():
                raise RoundAborted("round stopped between received chunks")
            slot = k % n
            if self._in_flight[slot]:
                self._sync(slot)
            buf = self._slots.slot(slot, chunk.nbytes)
            self._in_flight[slot].append(buf)
            if self._packed:
                self._comm.broadcast(
                    buf, root=root, timeout=self._timeout, stream=self._streams[slot]
                )
            else:
                self._broadcast_tensor(buf, metas[chunk.start], root, self._streams[slot])
        self.settle()

    def _send_unpacked(self, out: Outgoing) -> Sent:
        """One broadcast per tensor with its own NCCL dtype (what a stock vLLM worker posts)."""
        stream, held, begin = self._streams[0], 0, out.begin
        nbytes = count = 0
        for chunk, tensors in out.prepared:
            if out.stop.is_set():
                raise RoundAborted("round stopped between tensors")
            meta = out.metas[chunk.start]
            (buf,) = self._packer.regions(tensors[:1], stream)
            self._in_flight[0].append((buf, tensors))
            begin = run_once(begin)
            self._broadcast_tensor(buf, meta, out.root, stream)
            held += meta.nbytes
            nbytes, count = nbytes + meta.nbytes, count + 1
            if held > self._hold_bytes:  # bounds memory held by per-tensor temporaries (casts)
                self._sync(0)
                held = 0
        run_once(begin)
        self.settle()
        return Sent(nbytes, count)

    def _broadcast_tensor(self, buf: Any, meta: ParamMeta, root: int, stream: Any) -> None:
        """One tensor's broadcast with its own NCCL dtype (unpacked rounds)."""
        self._comm.broadcast_typed(
            buf,
            nccl_dtype=wire_dtype(meta.dtype).nccl,
            count=meta.numel,
            root=root,
            timeout=self._timeout,
            stream=stream,
        )
