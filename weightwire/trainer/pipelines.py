"""Rank 0's data path: cut a round into broadcasts and keep the wire busy.

Two pipelines, both fed ``(Chunk, tensors)`` pairs in plan order (``chunked``):

- ``HostPipeline`` (TCP): the caller's thread turns chunk k+1 into host bytes while a
  sender thread broadcasts chunk k. At most ``num_buffers`` chunks exist as host
  bytes at once. A chunk goes out as its list of parts (one logical buffer, no
  concatenation copy).
- ``DevicePipeline`` (NCCL): chunk k is gathered into slot ``k % num_buffers``'s
  reusable device buffer by the framework's ``DevicePacker`` and broadcast on that
  slot's stream, so packing k+1 overlaps broadcasting k. The host waits only when a
  slot comes round again (for the chunk ``num_buffers`` back) and at the final
  drain; every wait goes through ``comm.synchronize`` with a timeout.

Both take a ``begin`` callback, run once the first chunk is prepared and before its
first byte goes out: the engine puts the control plane there (``start_weight_update``,
then the update POST), so the first chunk's packing overlaps those round trips
instead of following them. If ``begin`` raises, nothing was broadcast.

Framework code lives behind two hooks: ``host_bytes(tensor)`` and ``DevicePacker`` (whose
shared implementation, ``SlotPacker``, leaves a framework only ``new_stream`` and ``regions``).
"""

from __future__ import annotations

import itertools
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from weightwire.shared.communicator import Communicator, DeviceCommunicator, TransferError, TransferTimeout
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta

Prepared = tuple[Chunk, list[Any]]
HostBytes = Callable[[Any], np.ndarray]
Begin = Callable[[], None] | None


class RoundAborted(TransferError):
    """The round was stopped from outside (the update POST failed) between broadcasts."""


def check_chunk_bytes(chunk: Chunk, got: int) -> None:
    """The bytes a chunk's tensors produced must be what the plan (and so the workers) expect."""
    if got != chunk.nbytes:
        raise ValueError(f"tensors {chunk.start}..{chunk.stop - 1} produced {got} bytes, the plan says {chunk.nbytes}")


def chunked(pairs: Iterable[tuple[str, Any]], chunks: Sequence[Chunk]) -> Iterator[Prepared]:
    """Group a checked ``(name, tensor)`` stream by the round's plan.

    After the last chunk the stream is pulled once more, so ``checked_iter``'s end
    check (an extra or a missing tensor) fires before the round is declared done.
    """
    it = iter(pairs)
    for chunk in chunks:
        tensors = [tensor for _, tensor in itertools.islice(it, len(chunk))]
        yield chunk, tensors
    next(it, None)


class HostPipeline:
    """Host-byte broadcasts with one chunk in preparation while another is sent."""

    def __init__(self, comm: Communicator, host_bytes: HostBytes, *, num_buffers: int, timeout: float,
                 prefetch: Callable[[list[Any]], None] | None = None) -> None:
        self._comm = comm
        self._host_bytes = host_bytes
        self._depth = max(1, num_buffers - 1)  # queued chunks; one more is on the wire
        self._timeout = timeout
        self._prefetch = prefetch

    def send(self, prepared: Iterable[Prepared], stop: threading.Event, begin: Begin = None) -> tuple[int, int]:
        """Broadcast every chunk; returns ``(bytes, broadcasts)`` once all were sent."""
        work: queue.Queue[list[np.ndarray] | None] = queue.Queue(maxsize=self._depth)
        failure: list[BaseException] = []
        thread = threading.Thread(target=self._sender, args=(work, stop, failure), name="weightwire-send", daemon=True)
        thread.start()
        nbytes = count = 0
        try:
            for chunk, tensors in prepared:
                if self._prefetch is not None:
                    self._prefetch(tensors)
                parts = [self._host_bytes(t) for t in tensors]
                got = sum(p.nbytes for p in parts)
                check_chunk_bytes(chunk, got)
                begin = _run_once(begin)
                self._put(work, parts, stop, failure)
                nbytes, count = nbytes + got, count + 1
            begin = _run_once(begin)
            self._put(work, None, stop, failure)
            # Each queued broadcast is bounded by its own timeout; this only guards the thread.
            thread.join(self._timeout * (self._depth + 1) + 5.0)
            if thread.is_alive():
                raise TransferTimeout(f"host sender did not drain within {self._timeout * (self._depth + 1):.0f} s")
        except BaseException:
            stop.set()
            if failure:  # the sender's error is the cause; ours is a consequence
                raise failure[0] from None
            raise
        if failure:
            raise failure[0]
        return nbytes, count

    def _put(self, work: queue.Queue, item: Any, stop: threading.Event, failure: list[BaseException]) -> None:
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

    def _sender(self, work: queue.Queue, stop: threading.Event, failure: list[BaseException]) -> None:
        try:
            while not stop.is_set():
                try:
                    parts = work.get(timeout=0.05)
                except queue.Empty:
                    continue
                if parts is None:
                    return
                self._comm.broadcast(parts, root=0, timeout=self._timeout)
        except BaseException as exc:
            failure.append(exc)
            stop.set()


class DevicePacker(ABC):
    """Framework hook for the NCCL path. Buffers are CuPy arrays on the sender's device;
    "stream-ordered" means: safe to read by later work enqueued on ``stream``, with no
    further host synchronization."""

    @abstractmethod
    def new_stream(self) -> Any:
        """A CuPy stream (``Stream`` or ``ExternalStream``) on the sender's device."""

    @abstractmethod
    def pack(self, tensors: Sequence[Any], nbytes: int, stream: Any, slot: int) -> Any:
        """A ``uint8`` buffer of ``nbytes``: the tensors' C-order bytes back to back,
        stream-ordered on ``stream``. It may be slot ``slot``'s reused buffer: the
        pipeline packs into a slot only after the broadcast that last read it ended."""

    @abstractmethod
    def wire(self, tensor: Any, stream: Any) -> Any:
        """One tensor's bytes for the communicator (a CuPy array, or a ``DeviceBytes``
        pointer whose producer is already ordered before ``stream``); zero-copy where possible."""

    def regions(self, tensors: Sequence[Any], stream: Any) -> list[Any]:
        """Each tensor's own device bytes (``DeviceBytes``), zero-copy where possible and
        ordered before ``stream``: the IPC path copies them straight into its slots."""
        return [self.wire(t, stream) for t in tensors]

    def settled(self, slot: int) -> None:
        """Everything enqueued on slot ``slot``'s stream finished: drop what ``pack`` kept alive for it."""
        return None

    def receive_buffer(self, nbytes: int, slot: int) -> Any:
        """A ``uint8`` device buffer of ``nbytes`` for another broadcaster's chunk, which is
        received and dropped (several broadcasters in one NCCL group: ``DevicePipeline.discard``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive another broadcaster's chunks")

    def release(self) -> None:
        """Free any buffers kept between rounds (the engine is shutting down)."""
        return None


class SlotPacker(DevicePacker):
    """The ``DevicePacker`` both framework packers are: a chunk is gathered into the slot's
    reusable buffer (``backends.nccl.buffers.SlotBuffers``: one device-to-device copy per
    tensor) from the tensors' own device bytes, and an unpacked tensor goes out as its
    own bytes. A framework implements ``new_stream`` and ``regions`` only; ``regions``
    must order each tensor's producer before ``stream``.
    """

    def __init__(self, ordinal: int) -> None:
        import cupy  # GPU hosts only

        from weightwire.backends.nccl.buffers import SlotBuffers

        self._cupy = cupy
        self._ordinal = ordinal
        self._buffers = SlotBuffers(cupy, ordinal)

    @abstractmethod
    def regions(self, tensors: Sequence[Any], stream: Any) -> list[Any]:
        """Each tensor's own device bytes (``DeviceBytes``), zero-copy where possible."""

    def pack(self, tensors: Sequence[Any], nbytes: int, stream: Any, slot: int) -> Any:
        return self._buffers.gather(slot, self.regions(tensors, stream), nbytes, stream)

    def wire(self, tensor: Any, stream: Any) -> Any:
        (region,) = self.regions([tensor], stream)
        return region

    def settled(self, slot: int) -> None:
        self._buffers.settled(slot)

    def receive_buffer(self, nbytes: int, slot: int) -> Any:
        return self._buffers.slot(slot, nbytes)

    def release(self) -> None:
        self._buffers.release()


class DevicePipeline:
    """Device-buffer broadcasts on ``num_buffers`` rotating streams.

    Streams are created once per engine: a caching allocator keys freed blocks by
    stream, so fresh streams every round would strand memory. Buffers in flight are
    held on ``self`` until their stream is known complete, also across an error (the
    caller aborts the communicator, which stops the kernels that read them).
    """

    def __init__(self, comm: DeviceCommunicator, packer: DevicePacker, *, num_buffers: int, timeout: float,
                 hold_bytes: int) -> None:
        self._comm = comm
        self._packer = packer
        self._timeout = timeout
        self._hold_bytes = hold_bytes
        self._streams = [packer.new_stream() for _ in range(num_buffers)]
        self._in_flight: list[list[Any]] = [[] for _ in range(num_buffers)]

    def _sync(self, slot: int) -> None:
        self._comm.synchronize(self._streams[slot], timeout=self._timeout)
        self._in_flight[slot].clear()
        self._packer.settled(slot)

    def drain(self) -> None:
        for slot in range(len(self._streams)):
            self._sync(slot)

    def close(self) -> None:
        self._in_flight = [[] for _ in self._streams]
        self._packer.release()

    def send_packed(self, prepared: Iterable[Prepared], stop: threading.Event, begin: Begin = None,
                    root: int = 0) -> tuple[int, int]:
        """``root``: this rank's rank in the group (a non-zero broadcaster's ``src``)."""
        n = len(self._streams)
        nbytes = count = 0
        for k, (chunk, tensors) in enumerate(prepared):
            if stop.is_set():
                raise RoundAborted("round stopped between chunks")
            slot = k % n
            if self._in_flight[slot]:
                self._sync(slot)  # the chunk n back on this stream: its buffer may now be dropped
            stream = self._streams[slot]
            buf = self._packer.pack(tensors, chunk.nbytes, stream, slot)
            self._in_flight[slot].append((buf, tensors))
            begin = _run_once(begin)  # the control plane's round trips overlap the first pack
            self._comm.broadcast(buf, root=root, timeout=self._timeout, stream=stream)
            nbytes, count = nbytes + chunk.nbytes, count + 1
        _run_once(begin)
        self.drain()
        return nbytes, count

    def discard(self, chunks: Sequence[Chunk], metas: Sequence[ParamMeta], *, root: int, packed: bool,
                stop: threading.Event) -> None:
        """Receive another broadcaster's turn (``root``) and drop it: an NCCL broadcast is
        collective over the whole communicator, so a group member that skipped it would
        hang every other member. Same slot rotation and waits as ``send_packed``."""
        n = len(self._streams)
        for k, chunk in enumerate(chunks):
            if stop.is_set():
                raise RoundAborted("round stopped between received chunks")
            slot = k % n
            if self._in_flight[slot]:
                self._sync(slot)
            buf = self._packer.receive_buffer(chunk.nbytes, slot)
            self._in_flight[slot].append(buf)
            if packed:
                self._comm.broadcast(buf, root=root, timeout=self._timeout, stream=self._streams[slot])
            else:
                meta = metas[chunk.start]
                self._comm.broadcast_typed(buf, nccl_dtype=wire_dtype(meta.dtype).nccl, count=meta.numel,
                                           root=root, timeout=self._timeout, stream=self._streams[slot])
        self.drain()

    def send_unpacked(self, prepared: Iterable[Prepared], metas: Sequence[ParamMeta], stop: threading.Event,
                      begin: Begin = None, root: int = 0) -> tuple[int, int]:
        """One broadcast per tensor with its own NCCL dtype (what a stock vLLM worker posts)."""
        stream, held = self._streams[0], 0
        nbytes = count = 0
        for chunk, tensors in prepared:
            if stop.is_set():
                raise RoundAborted("round stopped between tensors")
            meta = metas[chunk.start]
            buf = self._packer.wire(tensors[0], stream)
            self._in_flight[0].append((buf, tensors))
            begin = _run_once(begin)
            self._comm.broadcast_typed(buf, nccl_dtype=wire_dtype(meta.dtype).nccl, count=meta.numel,
                                       root=root, timeout=self._timeout, stream=stream)
            held += meta.nbytes
            nbytes, count = nbytes + meta.nbytes, count + 1
            if held > self._hold_bytes:  # bounds memory held by per-tensor temporaries (casts)
                self._sync(0)
                held = 0
        _run_once(begin)
        self.drain()
        return nbytes, count


def _run_once(begin: Begin) -> Begin:
    """Call ``begin`` if it is still pending; returns the new pending value (always ``None``)."""
    if begin is not None:
        begin()
    return None
