"""Sliced rounds on ``weightwire_nccl``: the workers' hellos and each worker's pieces, point
to point (``ncclSend`` / ``ncclRecv``, grouped) on the session's one communicator.

**Hellos.** A worker asked for its wants (the init info's ``sliced``) sends rank 0 two
messages right after the warm-up, never waiting on them in its init: its hello's length
(``LENGTH``: u64), then the hello (none when empty). Rank 0 receives every worker's length
in one group, then every hello in one group, right after its own warm-up while the init POST
is still in flight (NCCL connects a pair of ranks on both sides' first call: a worker's
first send waits there for rank 0's receive).

**A sliced update**, per worker, in this order (all from rank 0)::

    LENGTH of the table | table | chunk 0 | chunk 1 | ...
    table = count u32 | buffer_bytes u64 | count x piece header (shared.slice_wire)

The chunks carry the table's pieces in its order, packed as ``shared.slice_wire.chunk_layout``
lays them out for ``buffer_bytes`` (both ends derive the same chunks from the table). A
worker given nothing gets a table of no pieces and no chunk. Rank 0 packs each worker's
chunk on its own device (each piece a device-to-device copy of a box cut on the shard's
device: nothing is gathered), then sends wave ``k`` (chunk ``k`` of every worker that has
one) as one NCCL group on stream ``k % depth``: ``depth`` waves in flight, each worker one
slot per stream, so rank 0's extra device memory is ``depth x workers`` chunk buffers of
at most ``buffer_bytes`` each (a piece is cut to fit one, ``shared.slices.split_box``).

Every wait is a communicator ``synchronize`` (bounded; on timeout the communicator is
aborted, so every peer's pending receive fails too).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, cast

import numpy as np

from weightwire.backends.base import (
    DevicePacker,
    Outgoing,
    RoundAborted,
    RoundSender,
    Sent,
    SlicePiece,
)
from weightwire.backends.device import DeviceBytes
from weightwire.backends.nccl.comm import NCCLCommunicator
from weightwire.shared.errors import TransferError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slice_wire import (
    ChunkSpan,
    Piece,
    chunk_layout,
    piece_bytes,
    piece_header,
    read_heads,
)

LENGTH = struct.Struct("!Q")
TABLE_HEAD = struct.Struct("!IQ")
MAX_HELLO_BYTES = 64 << 20
"""A hello longer than this is refused (a worker's wants are a few hundred bytes a tensor)."""
MAX_TABLE_BYTES = 256 << 20
"""A sliced update's table longer than this is refused before it is received."""


# -- hellos ------------------------------------------------------------------------------------


def send_hello(comm: NCCLCommunicator, hello: bytes, buffers: Any, stream: Any) -> None:
    """A worker's hello to rank 0, enqueued on ``stream`` (never waited on here: rank 0
    receives it beside this worker's init). ``buffers(data)`` makes a device buffer of
    ``data`` the communicator can send."""
    if len(hello) > MAX_HELLO_BYTES:
        raise TransferError(
            f"this worker's hello is {len(hello)} bytes, over the {MAX_HELLO_BYTES}-byte bound"
        )
    comm.send(buffers(LENGTH.pack(len(hello))), peer=0, stream=stream)
    if hello:
        comm.send(buffers(hello), peer=0, stream=stream)


def recv_hellos(comm: NCCLCommunicator, *, timeout: float) -> list[bytes]:
    """Rank 0: every worker's hello (ranks 1 .. world_size - 1, in order)."""
    peers = range(1, comm.world_size)
    stream = comm.new_stream()
    lengths = [comm.buffer(LENGTH.size) for _ in peers]
    with comm.group():
        for peer, buf in zip(peers, lengths, strict=True):
            comm.recv(buf, peer=peer, stream=stream)
    comm.synchronize(stream, timeout=timeout)
    sizes = [LENGTH.unpack(_host(buf))[0] for buf in lengths]
    for peer, size in zip(peers, sizes, strict=True):
        if size > MAX_HELLO_BYTES:
            comm.abort()
            raise TransferError(
                f"NCCL rank {peer} sent a {size}-byte hello, over the {MAX_HELLO_BYTES}-byte "
                "bound: is it a weightwire worker of this version?"
            )
    bodies = [comm.buffer(size) if size else None for size in sizes]
    with comm.group():
        for peer, body in zip(peers, bodies, strict=True):
            if body is not None:
                comm.recv(body, peer=peer, stream=stream)
    comm.synchronize(stream, timeout=timeout)
    return [b"" if body is None else _host(body) for body in bodies]


def _host(array: Any) -> bytes:
    return bytes(np.asarray(array.get()).tobytes())


# -- one worker's table --------------------------------------------------------------------


def table_bytes(heads: Sequence[tuple[int, Any]], buffer_bytes: int) -> bytes:
    return TABLE_HEAD.pack(len(heads), buffer_bytes) + b"".join(
        piece_header(t, box) for t, box in heads
    )


def parse_table(
    raw: bytes, metas: Sequence[ParamMeta], where: str
) -> tuple[list[Piece], list[ChunkSpan]]:
    """A worker's table: its pieces (checked against ``metas``; ``offset`` within its chunk)
    and the chunks that carry them."""
    view = memoryview(raw)
    what = f"{where}: a sliced table"
    (count, buffer_bytes), heads, end = read_heads(view, TABLE_HEAD, what)
    if end != len(view):
        raise TransferError(f"{what} holds {len(view) - end} bytes past its {count} headers")
    if count and buffer_bytes < 1:
        raise TransferError(f"{what} packs its pieces into chunks of {buffer_bytes} bytes")
    sizes = [piece_bytes(t, box, metas, where) for t, box in heads]
    spans, offsets = chunk_layout(sizes, max(1, buffer_bytes))
    pieces = [Piece(t, box, at, n) for (t, box), at, n in zip(heads, offsets, sizes, strict=True)]
    return pieces, spans


# -- rank 0's sender -----------------------------------------------------------------------


class NCCLSlicedSender(RoundSender):
    """Rank 0's sliced round on the session's communicator (module docstring).

    The round's pieces are metadata until read: every worker's table is known before any
    byte, each piece is read (``SlicePiece.read``: a device array cut from the shard that
    holds it) as its chunk is packed. ``begin`` (the control plane) runs once the first
    piece was read, before any byte."""

    device_pieces = True

    def __init__(
        self,
        comm: NCCLCommunicator,
        packer: DevicePacker,
        *,
        buffer_bytes: int,
        depth: int,
        timeout: float,
    ) -> None:
        self._comm = comm
        self._packer = packer
        self._buffer_bytes = buffer_bytes
        self._depth = max(1, depth)
        self._timeout = timeout
        self._streams: list[Any] = []
        self._slots: dict[tuple[int, int], Any] = {}  # (stream, worker) -> device buffer

    def held_bytes(self) -> int:
        """The device bytes this sender's chunk buffers hold (kept between rounds)."""
        return sum(int(b.nbytes) for b in self._slots.values())

    def send(self, out: Outgoing) -> Sent:
        comm = self._comm
        workers = comm.world_size - 1
        # a sliced round's prepared items are each tensor's pieces (see ``SlicePiece``)
        prepared = cast(Iterable[Iterable[SlicePiece]], out.prepared)
        mine: list[list[SlicePiece]] = [[] for _ in range(workers)]
        for pieces in prepared:
            for piece in pieces:
                mine[piece.worker].append(piece)
        sizes = [[_nbytes(p, out.metas) for p in ps] for ps in mine]
        layouts = [chunk_layout(ns, self._buffer_bytes) for ns in sizes]
        first = next((ps[0] for ps in mine if ps), None)
        early = None if first is None else first.read()  # a failing source: before begin
        if out.begin is not None:
            out.begin()
        self._check(out)
        self._send_tables(mine)
        waves = max((len(spans) for spans, _ in layouts), default=0)
        sent = [0, 0]
        for k in range(waves):
            self._check(out)
            slot = k % self._depth
            stream = self._stream(slot)
            if k >= self._depth:  # this stream's slots are free once its last wave left
                comm.synchronize(stream, timeout=self._timeout)
            keep: list[Any] = []
            sends: list[tuple[int, Any]] = []
            for w, (spans, offsets) in enumerate(layouts):
                if k >= len(spans):
                    continue
                span = spans[k]
                buf = self._slot(slot, w, span.nbytes)
                base = int(buf.data.ptr)
                for i in range(span.start, span.stop):
                    piece = mine[w][i]
                    if early is not None and piece is first:
                        data, early = early, None
                    else:
                        data = piece.read()
                    # ordered on this stream after whatever produced the piece
                    region = self._region(data, stream)
                    if region.nbytes != sizes[w][i]:  # the worker would read misplaced bytes
                        raise TransferError(
                            f"a piece of tensor #{piece.tensor}, box {piece.box.describe()}, "
                            f"was read as {region.nbytes} bytes; its table says {sizes[w][i]}"
                        )
                    comm.copy(base + offsets[i], region, stream)
                    keep.append(region.owner)
                    sent[0] += region.nbytes
                sends.append((w, buf[: span.nbytes]))
            with comm.group():
                for w, view in sends:
                    comm.send(view, peer=w + 1, stream=stream)
            sent[1] += len(sends)
            self._hold(stream, keep)
        for stream in self._streams:  # the tables' (head) stream and every wave's
            comm.synchronize(stream, timeout=self._timeout)
        return Sent(sent[0], sent[1])

    def _send_tables(self, mine: list[list[SlicePiece]]) -> None:
        comm, stream = self._comm, self._head_stream()
        tables = [table_bytes([(p.tensor, p.box) for p in ps], self._buffer_bytes) for ps in mine]
        lengths = [comm.upload(LENGTH.pack(len(t)), stream) for t in tables]
        bodies = [comm.upload(t, stream) for t in tables]
        with comm.group():
            for w, buf in enumerate(lengths):
                comm.send(buf, peer=w + 1, stream=stream)
        with comm.group():
            for w, buf in enumerate(bodies):
                comm.send(buf, peer=w + 1, stream=stream)

    def _region(self, data: Any, stream: Any) -> DeviceBytes:
        """A piece's device bytes on this device (a host array is copied up first)."""
        if isinstance(data, np.ndarray):
            data = self._comm.upload(np.ascontiguousarray(data).reshape(-1).view(np.uint8), stream)
        (region,) = self._packer.regions([data], stream)
        return cast(DeviceBytes, region)

    def _check(self, out: Outgoing) -> None:
        if out.stop.is_set():
            raise RoundAborted("the sliced round was stopped (its update POST failed)")

    def _head_stream(self) -> Any:
        return self._stream(-1)

    def _stream(self, slot: int) -> Any:
        while len(self._streams) <= slot + 1:
            self._streams.append(self._packer.new_stream())  # the packer knows its streams
        return self._streams[slot + 1]

    def _slot(self, slot: int, worker: int, nbytes: int) -> Any:
        buf = self._slots.get((slot, worker))
        if buf is None or int(buf.nbytes) < nbytes:
            buf = self._slots[(slot, worker)] = self._comm.buffer(max(nbytes, 1))
        return buf

    def _hold(self, stream: Any, owners: list[Any]) -> None:
        # the pieces' memory must outlive the copies enqueued on ``stream``: the
        # communicator keeps what it was handed until that stream is synchronized
        self._comm.keep(stream, owners)

    def close(self) -> None:
        self._slots.clear()


def _nbytes(piece: SlicePiece, metas: Sequence[ParamMeta]) -> int:
    return piece_bytes(piece.tensor, piece.box, metas, "rank 0's sliced round")


__all__ = [
    "MAX_HELLO_BYTES",
    "NCCLSlicedSender",
    "parse_table",
    "recv_hellos",
    "send_hello",
    "table_bytes",
]
