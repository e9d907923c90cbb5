"""Framing: how a round's tensors are cut into broadcasts.

Packed mode (vLLM's ``packed = true``): tensors' raw C-order bytes are concatenated in
update-info order; a chunk closes right after the tensor that makes its running total
*strictly greater* than the buffer size. No header, padding, alignment or splitting: a
chunk may exceed the buffer. Both sides derive the same plan from the update info and
the buffer size in the init info, so no chunk sizes ever travel.

Unpacked mode: one broadcast per tensor.

``pack_host`` / ``unpack_host`` are the numpy reference implementations used by CPU
communicators and by tests as the golden model for device packers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from weightwire.shared.checks import check_buffer_size
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.meta import ParamMeta


@dataclass(frozen=True)
class Chunk:
    """One broadcast: tensors ``start:stop`` of the round, ``nbytes`` in total.

    ``offsets[i]`` is the byte offset of tensor ``start + i`` inside the chunk.
    """

    start: int
    stop: int
    nbytes: int
    offsets: tuple[int, ...]

    def __len__(self) -> int:
        return self.stop - self.start


def plan_packed(metas: Sequence[ParamMeta], buffer_size_bytes: int) -> list[Chunk]:
    """The chunks of a packed round (empty round -> no chunks)."""
    check_buffer_size("packed_buffer_size_bytes", buffer_size_bytes)
    chunks: list[Chunk] = []
    start, total, offsets = 0, 0, []
    for i, meta in enumerate(metas):
        offsets.append(total)
        total += meta.nbytes
        if total > buffer_size_bytes:
            chunks.append(Chunk(start, i + 1, total, tuple(offsets)))
            start, total, offsets = i + 1, 0, []
    if start < len(metas):
        chunks.append(Chunk(start, len(metas), total, tuple(offsets)))
    return chunks


def plan_unpacked(metas: Sequence[ParamMeta]) -> list[Chunk]:
    """One chunk per tensor: the unpacked framing expressed in the same type."""
    return [Chunk(i, i + 1, m.nbytes, (0,)) for i, m in enumerate(metas)]


def plan(metas: Sequence[ParamMeta], *, packed: bool, buffer_size_bytes: int) -> list[Chunk]:
    return plan_packed(metas, buffer_size_bytes) if packed else plan_unpacked(metas)


def pack_host(
    arrays: Sequence[np.ndarray], chunk: Chunk, out: np.ndarray | None = None
) -> np.ndarray:
    """Concatenate the chunk's arrays' bytes into a uint8 buffer (``out`` if given).

    Each array must have exactly the byte size the plan gave its slot: a short array
    would otherwise leave stale bytes in the buffer that the receiver loads as
    weights. Big-endian arrays are converted, since the wire is little-endian.
    """
    if out is None:
        out = np.empty(chunk.nbytes, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.ndim != 1 or out.size < chunk.nbytes:
        raise ValueError(f"pack buffer must be a 1-D uint8 array of >= {chunk.nbytes} bytes")
    if len(arrays) != len(chunk):
        raise ValueError(f"chunk holds {len(chunk)} tensors, got {len(arrays)} arrays")
    ends = (*chunk.offsets[1:], chunk.nbytes)
    for i, (arr, offset, end) in enumerate(zip(arrays, chunk.offsets, ends, strict=True)):
        arr = np.asarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if arr.nbytes != end - offset:
            raise ValueError(
                f"tensor {chunk.start + i} of the round has {arr.nbytes} bytes, "
                f"its slot has {end - offset}"
            )
        out[offset:end] = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return out[: chunk.nbytes]


def unpack_host(
    buffer: np.ndarray, metas: Sequence[ParamMeta], chunk: Chunk, *, copy: bool = True
) -> Iterator[tuple[str, np.ndarray]]:
    """Split a received chunk back into ``(name, array)`` of each tensor's dtype/shape.

    ``copy=False`` yields views into ``buffer`` (valid until it is reused).
    """
    if buffer.nbytes < chunk.nbytes:
        raise ValueError(f"chunk buffer holds {buffer.nbytes} bytes, chunk needs {chunk.nbytes}")
    raw = buffer.reshape(-1).view(np.uint8)
    for meta, offset in zip(metas[chunk.start : chunk.stop], chunk.offsets, strict=True):
        row = wire_dtype(meta.dtype)
        view = raw[offset : offset + meta.nbytes].view(row.numpy).reshape(meta.shape)
        yield meta.name, (view.copy() if copy else view)
