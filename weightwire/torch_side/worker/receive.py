"""Where a worker's bytes land: the ``ReceiveLink`` contract and chunk unpacking.

A *link* receives the chunks of a round (``shared.framing.plan``) into uint8 torch
buffers on the worker's device, with up to ``depth`` (= ``packed_num_buffers``)
chunks in flight, so the network fills chunk ``i + 1`` while chunk ``i`` is being
loaded into the model.

Every chunk lands in a *fresh* allocation (the torch allocator recycles it once
nothing references it). That is deliberate: vLLM's layerwise reload keeps the
tensors handed to ``load_weights`` until their whole layer has arrived, and
``HFModelHost`` keeps them until commit, so a buffer reused in place would silently
overwrite weights still waiting to be applied. ``depth`` bounds how many chunks are
in flight, not how many allocations exist.

Each backend's link and connect function live in its package
(``weightwire.backends.<name>.worker``); ``connect`` picks one through the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import torch_dtype

_VIEW, _CLONE, _EMPTY = 0, 1, 2  # how an UnpackPlan entry is made: in place, copied out, fresh empty


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


class UnpackPlan:
    """How one chunk's buffer becomes its ``(name, tensor)`` views, worked out once per
    ``(metas, chunk)`` (the worker reuses a round's metadata, so this is per session, not
    per round): a round then costs one tensor op per tensor instead of three plus the
    dtype and size lookups, on the critical path of every round.

    Each aligned tensor is an ``as_strided`` view of one typed view of the buffer per
    dtype: the same storage, offset, shape and strides as ``buffer[o:o + n].view(dtype)
    .view(shape)``. The packed framing has no alignment, so a tensor whose offset is
    not a multiple of its itemsize cannot be viewed in place (torch refuses): it is
    copied out. A zero-size tensor is a fresh empty tensor (torch cannot reinterpret
    an empty slice's zero stride).
    """

    __slots__ = ("nbytes", "in_place", "_entries", "_typed")

    def __init__(self, metas: Sequence[ParamMeta], chunk: Chunk) -> None:
        self.nbytes = chunk.nbytes
        # Per tensor: (name, kind, dtype, shape, strides, element offset in the typed view, byte offset, nbytes).
        entries: list[tuple[str, int, torch.dtype, tuple[int, ...], tuple[int, ...], int, int, int]] = []
        typed: dict[torch.dtype, int] = {}  # dtype -> bytes of the buffer its typed view covers
        for meta, offset in zip(metas[chunk.start : chunk.stop], chunk.offsets, strict=True):
            dtype = torch_dtype(meta.dtype)
            itemsize = dtype.itemsize
            nbytes = meta.numel * itemsize
            if nbytes == 0:
                kind = _EMPTY
            elif offset % itemsize:
                kind = _CLONE
            else:
                kind = _VIEW
                typed[dtype] = max(typed.get(dtype, 0), offset + nbytes)  # a multiple of itemsize
            entries.append((meta.name, kind, dtype, meta.shape, _c_strides(meta.shape), offset // itemsize,
                            offset, nbytes))
        self._entries = tuple(entries)
        self._typed = tuple(typed.items())
        self.in_place = all(e[1] != _CLONE for e in entries)
        """Only views and fresh empties: ``unpack`` runs no device work, so it may run
        before the buffer's bytes landed (``ReceiveLink.wait_unpacked``)."""

    def __len__(self) -> int:
        return len(self._entries)

    def unpack(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The chunk's tensors from ``buffer`` (1-D ``uint8``, at least ``nbytes``; views
        into it except the copied-out unaligned ones)."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.nbytes:
            raise ValueError(f"chunk buffer must be 1-D uint8 of >= {self.nbytes} bytes")
        # One typed view per dtype; as_strided offsets are absolute in the storage.
        views = {}
        for dtype, end in self._typed:
            view = buffer[:end].view(dtype)
            views[dtype] = (view.as_strided, view.storage_offset())
        out: list[tuple[str, torch.Tensor]] = []
        append = out.append
        for name, kind, dtype, shape, strides, element, offset, nbytes in self._entries:
            if kind == _VIEW:
                strided, base = views[dtype]
                append((name, strided(shape, strides, base + element)))
            elif kind == _CLONE:
                append((name, buffer[offset : offset + nbytes].clone().view(dtype).view(shape)))
            else:
                append((name, torch.empty(shape, dtype=dtype, device=buffer.device)))
        return out


def unpack_chunk(buffer: torch.Tensor, metas: Sequence[ParamMeta], chunk: Chunk,
                 plan: UnpackPlan | None = None) -> list[tuple[str, torch.Tensor]]:
    """Split a received chunk into ``(name, tensor)`` views of each tensor's dtype/shape.

    ``plan``: this chunk's ``UnpackPlan`` when the caller keeps one (it must have been
    made from the same ``metas`` and ``chunk``); otherwise one is made for this call.
    """
    return (plan if plan is not None else UnpackPlan(metas, chunk)).unpack(buffer)


class ReceiveLink(ABC):
    """One worker's receiving end of the data plane, chunk by chunk.

    ``post(i, ...)`` starts receiving chunk ``i``; ``wait(i)`` returns its buffer once
    every byte landed (bounded by the link's timeout). Chunks must be posted and
    waited in order. After any error the caller must ``abort()``: a half-received
    stream cannot be resumed.
    """

    def __init__(self, communicator: Any, *, device: torch.device, timeout_s: float, depth: int) -> None:
        self.communicator = communicator
        self.device = device
        self.timeout_s = float(timeout_s)
        self.depth = int(depth)

    @abstractmethod
    def post(self, index: int, chunk: Chunk, metas: Sequence[ParamMeta], *, packed: bool) -> None: ...

    @abstractmethod
    def wait(self, index: int) -> torch.Tensor: ...

    def wait_unpacked(self, index: int, plan: UnpackPlan) -> list[tuple[str, torch.Tensor]]:
        """``wait(index)`` and then chunk ``index``'s ``(name, tensor)`` pairs by ``plan``.
        A link that knows a chunk's buffer before its bytes land may make the views first,
        while it waits (``weightwire_ipc`` pull mode): the same pairs, off the critical path."""
        return plan.unpack(self.wait(index))

    def round_started(self) -> None:
        """A round started (``start_weight_update``): a link may get the coming update's
        first chunks ready here (``weightwire_ipc`` pull mode names their buffers early).
        Must not block on the trainer."""
        return None  # most links need nothing before the update arrives

    def for_src(self, src: int) -> ReceiveLink:
        """The link that receives a turn broadcast by group rank ``src`` (see
        ``sources.MultiSourceLink``); a single-sender link takes only ``src`` 0."""
        if src != 0:
            raise ValueError(f"update info names src {src}, but this engine was initialized with one "
                             "broadcasting trainer rank (rank_offset 1): only src 0 can be received")
        return self

    def abort(self) -> None:
        self.communicator.abort()

    def peer_closed(self) -> bool:
        """True when the trainer is known to be gone (it closed the link). Only TCP can
        tell without traffic; an NCCL peer's death shows only as a timeout."""
        probe = getattr(self.communicator, "peer_closed", None)
        return bool(probe()) if callable(probe) else False

    def close(self) -> None:
        self.communicator.close()
