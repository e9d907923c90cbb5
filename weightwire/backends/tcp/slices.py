"""A sliced round on ``weightwire_tcp``: each worker's pieces, framed on its own link.

Rank 0 sends every worker only the boxes the slice plan gives it (``trainer.slice_plan``),
as ``WWSL`` frames on that worker's connection (``wire``). One frame's payload::

    count u32 | last u8 | count x (tensor u32 | ndim u8 | ndim x (lo u64 | hi u64)) | pad |
    piece 0 | pad | piece 1 | pad | ...

``tensor`` indexes the update's tensors (``UpdateInfo.names``); the pieces' bytes follow the
headers (``shared.slice_wire``: the piece headers and the pieces' alignment both
transports share). ``last`` marks the update's final frame (a worker given nothing gets one
empty last frame). A frame is sent once its pieces reach ``buffer_bytes``; the trainer cuts a
piece larger than that along its first dimension first (``shared.slices.split_box``), so a
frame stays near the buffer's size whatever a tensor's.

The receiver checks every header against the update's tensors before it uses a byte of
the frame: index in range, rank equal to the tensor's, box inside it and non-empty, the
bytes exactly the pieces' sizes (the frame's length is bounded before it is read).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, cast

from weightwire.backends.base import Outgoing, RoundAborted, RoundSender, Sent, SlicePiece
from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.shared.errors import TransferError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slice_wire import PAD, Piece, aligned, piece_header, place, read_heads

FRAME_HEAD = struct.Struct("!IB")


def frame_header(count: int, last: bool) -> bytes:
    return FRAME_HEAD.pack(count, 1 if last else 0)


def parse_frame(
    payload: bytes | bytearray | memoryview, metas: Sequence[ParamMeta], where: str
) -> tuple[list[Piece], bool]:
    """A frame's pieces (checked against ``metas``) and whether it is the update's last."""
    view = memoryview(payload)
    what = f"{where}: a sliced frame"
    # a frame's head is counted with its piece headers (one message for both)
    (_, last), heads, at = read_heads(view, FRAME_HEAD, what, "piece headers")
    pieces, offset = place(heads, metas, at, where)
    if offset != len(view):
        raise TransferError(
            f"{where}: a sliced frame's pieces take {offset} bytes, the frame has {len(view)}"
        )
    return pieces, bool(last)


class TCPSlicedSender(RoundSender):
    """Rank 0's sliced round: each worker's pieces as frames on its own link.

    Pieces are read (``SlicePiece.read``: a slice of a shard the trainer holds, never a
    gathered tensor) in the round's tensor order and held per worker until that worker's
    frame reaches ``buffer_bytes``, then sent; so rank 0's extra host memory is about one
    frame per worker. ``begin`` (the control plane) runs once the first piece was read,
    before any byte."""

    def __init__(self, comm: TCPCommunicator, *, buffer_bytes: int, timeout: float) -> None:
        self._comm = comm
        self._buffer_bytes = buffer_bytes
        self._timeout = timeout

    def send(self, out: Outgoing) -> Sent:
        # a sliced round's prepared items are each tensor's pieces (see ``SlicePiece``)
        prepared = cast(Iterable[Iterable[SlicePiece]], out.prepared)
        stop, begin = out.stop, out.begin
        workers = self._comm.world_size - 1
        frames = [_Frame() for _ in range(workers)]
        sent = [0, 0]  # the pieces' bytes (headers and padding not counted), frames

        def flush(worker: int, last: bool) -> None:
            if stop.is_set():
                raise RoundAborted("the sliced round was stopped (its update POST failed)")
            frame = frames[worker]
            head = b"".join([frame_header(len(frame.heads), last), *frame.heads])
            parts: list[Any] = [head, PAD[: aligned(len(head)) - len(head)]]
            for data in frame.data:
                parts += [data, PAD[: aligned(data.nbytes) - data.nbytes]]
            self._comm.send_frame(worker + 1, parts, seq=frame.seq, timeout=self._timeout)
            sent[0] += frame.nbytes
            sent[1] += 1
            frames[worker] = _Frame(frame.seq + 1)

        began = begin is None
        for pieces in prepared:
            for piece in pieces:
                data = piece.read()
                if not began:
                    assert begin is not None
                    begin()
                    began = True
                frame = frames[piece.worker]
                frame.heads.append(piece_header(piece.tensor, piece.box))
                frame.data.append(data)
                frame.nbytes += data.nbytes
                if frame.nbytes >= self._buffer_bytes:
                    flush(piece.worker, last=False)
        if not began:
            assert begin is not None
            begin()
        for worker in range(workers):
            flush(worker, last=True)
        return Sent(sent[0], sent[1])


class _Frame:
    """One worker's frame being filled."""

    def __init__(self, seq: int = 0) -> None:
        self.seq = seq
        self.heads: list[bytes] = []
        self.data: list[Any] = []
        self.nbytes = 0


__all__ = ["Piece", "TCPSlicedSender", "frame_header", "parse_frame", "piece_header"]
