"""How a sliced round's pieces travel, whatever carries them: the piece headers, where each
piece sits in the bytes that carry it, and the receiver's checks of both.

One piece is ``box`` of the update's tensor number ``tensor`` (``UpdateInfo.names``), its
bytes a C-order box of the tensor in its wire dtype. A header names it::

    tensor u32 | ndim u8 | ndim x (lo u64 | hi u64)

Each piece starts at a multiple of ``ALIGN`` bytes of the buffer that carries it (zero
padding between), so a receiver views it in its dtype without a copy. ``weightwire_tcp``
frames pieces with their headers in front (``backends.tcp.slices``); ``weightwire_nccl``
sends one worker's table of headers first, then the pieces packed into chunks
(``chunk_layout``: both ends derive the same chunks from the table).

A receiver checks every header against the update's tensors before it uses a byte of the
pieces (``place``): index in range, rank equal to the tensor's, box inside it and non-empty.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import TransferError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box

PIECE_HEAD = struct.Struct("!IB")
RANGE = struct.Struct("!QQ")
ALIGN = 8
"""Each piece starts at a multiple of this many bytes (the largest wire itemsize)."""
PAD = bytes(ALIGN)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def piece_header(tensor: int, box: Box) -> bytes:
    return PIECE_HEAD.pack(tensor, box.ndim) + b"".join(RANGE.pack(lo, hi) for lo, hi in box.ranges)


def read_heads(
    view: memoryview, head: struct.Struct, what: str, head_part: str = "head"
) -> tuple[tuple[int, ...], list[tuple[int, Box]], int]:
    """A message that starts with ``head`` (its first field the piece count) and that many
    piece headers: the head's fields, the headers and where they end. ``TransferError``
    naming ``what`` when the bytes end inside the head (called ``head_part`` there) or the
    headers."""
    try:
        fields = head.unpack_from(view, 0)
    except struct.error:
        raise TransferError(f"{what} of {len(view)} bytes ends inside its {head_part}") from None
    at, heads = head.size, []
    try:
        for _ in range(fields[0]):
            tensor, ndim = PIECE_HEAD.unpack_from(view, at)
            at += PIECE_HEAD.size
            ranges = []
            for _ in range(ndim):
                ranges.append(RANGE.unpack_from(view, at))
                at += RANGE.size
            heads.append((tensor, Box(tuple(ranges))))
    except struct.error:
        raise TransferError(f"{what} of {len(view)} bytes ends inside its piece headers") from None
    return fields, heads, at


@dataclass(frozen=True)
class Piece:
    """One received piece: ``box`` of ``metas[tensor]``, its bytes at ``offset`` of the
    buffer that carries it."""

    tensor: int
    box: Box
    offset: int
    nbytes: int


def piece_bytes(tensor: int, box: Box, metas: Sequence[ParamMeta], where: str) -> int:
    """The bytes of ``box`` of ``metas[tensor]``, after the receiver's checks of the header."""
    if not 0 <= tensor < len(metas):
        raise TransferError(
            f"{where}: a piece names tensor #{tensor}; the update lists {len(metas)}"
        )
    meta = metas[tensor]
    if box.empty or not box.within(meta.shape):
        raise TransferError(
            f"{where}: a piece of {meta.name!r} is box {box.describe()}, empty or outside "
            f"its shape {list(meta.shape)}"
        )
    return box.volume * wire_dtype(meta.dtype).itemsize


def place(
    heads: Sequence[tuple[int, Box]], metas: Sequence[ParamMeta], offset: int, where: str
) -> tuple[list[Piece], int]:
    """The pieces ``heads`` name (checked against ``metas``) laid back to back from
    ``offset``, each at an aligned offset, and where the last one ends (aligned)."""
    pieces = []
    offset = aligned(offset)
    for tensor, box in heads:
        nbytes = piece_bytes(tensor, box, metas, where)
        pieces.append(Piece(tensor, box, offset, nbytes))
        offset = aligned(offset + nbytes)
    return pieces, offset


@dataclass(frozen=True)
class ChunkSpan:
    """Pieces ``start`` to ``stop - 1`` of a worker's table, carried by one chunk of
    ``nbytes`` (the last piece's end: no trailing padding)."""

    start: int
    stop: int
    nbytes: int


def chunk_layout(sizes: Sequence[int], buffer_bytes: int) -> tuple[list[ChunkSpan], list[int]]:
    """One worker's pieces (their sizes, in table order) packed into chunks: a chunk takes
    pieces while they fit ``buffer_bytes`` (a piece larger than that is a chunk alone), each
    at an aligned offset. Returns the chunks and every piece's offset in its chunk."""
    if buffer_bytes < 1:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    spans: list[ChunkSpan] = []
    offsets: list[int] = []
    start, end = 0, 0
    for i, n in enumerate(sizes):
        at = aligned(end) if i > start else 0
        if i > start and at + n > buffer_bytes:
            spans.append(ChunkSpan(start, i, end))
            start, at = i, 0
        offsets.append(at)
        end = at + n
    if len(sizes) > start:
        spans.append(ChunkSpan(start, len(sizes), end))
    return spans, offsets


__all__ = [
    "ALIGN",
    "PAD",
    "ChunkSpan",
    "Piece",
    "aligned",
    "chunk_layout",
    "piece_bytes",
    "piece_header",
    "place",
    "read_heads",
]
