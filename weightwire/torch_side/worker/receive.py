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

from collections.abc import Sequence
from enum import Enum

import torch

from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import torch_dtype


class _Kind(Enum):
    """How an ``UnpackPlan`` entry's tensor is made."""

    VIEW = "view"  # in place
    CLONE = "clone"  # copied out (unaligned)
    EMPTY = "empty"  # a fresh empty tensor (zero size)


_Entry = tuple[str, str, torch.dtype, tuple[int, ...], tuple[int, ...], int, int, int, int]
"""One tensor of a chunk, worked out once per metadata: ``(name, kind, dtype, shape,
strides, element, offset, nbytes, copied_at)``: ``kind`` a ``_Kind``'s value, ``element``
its offset in elements of the dtype's typed view of the buffer (a view's storage offset),
``offset`` in bytes in the buffer, ``copied_at`` (a copied-out, unaligned tensor) its byte
offset in the chunk's one copy of them. A plain tuple: ``unpack`` reads every field of
every entry on each round's critical path, and a tuple unpacks in one step (attribute reads
made a 580-tensor chunk ~40% slower); of atoms only (no enum member), so the first
collection that sees it untracks it: a delta round's plan, new each round with an entry per
wire tensor, is then not promoted towards a full collection by the round's young ones (#49).
"""

_ONE = (1,)


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    if len(shape) == 1:  # a patch's wire tensors: one shared tuple, not one per tensor
        return _ONE
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
    copied out, all of a chunk's such tensors in one ``cat`` (a delta round's chunk has
    one misaligned ``@index`` tensor per odd-sized ``@values`` before it: an 8B round's
    ~145, one launch each before), widest itemsize first so that each lands aligned in
    the copy. A zero-size tensor is a fresh empty tensor (torch cannot reinterpret an
    empty slice's zero stride).
    """

    __slots__ = ("nbytes", "in_place", "_entries", "_typed", "_copied")

    def __init__(self, metas: Sequence[ParamMeta], chunk: Chunk) -> None:
        self.nbytes = chunk.nbytes
        entries: list[_Entry] = []
        typed: dict[torch.dtype, int] = {}  # dtype -> bytes of the buffer its typed view covers
        for meta, offset in zip(metas[chunk.start : chunk.stop], chunk.offsets, strict=True):
            dtype = torch_dtype(meta.dtype)
            itemsize = dtype.itemsize
            nbytes = meta.numel * itemsize
            if nbytes == 0:
                kind = _Kind.EMPTY
            elif offset % itemsize:
                kind = _Kind.CLONE
            else:
                kind = _Kind.VIEW
                typed[dtype] = max(typed.get(dtype, 0), offset + nbytes)  # a multiple of itemsize
            entries.append(
                (
                    meta.name,
                    kind.value,
                    dtype,
                    meta.shape,
                    _c_strides(meta.shape),
                    offset // itemsize,
                    offset,
                    nbytes,
                    0,
                )
            )
        # The copied-out tensors' places in their one copy: widest itemsize first, so each
        # starts at a multiple of its own itemsize (every size before it is a multiple of it).
        clone = _Kind.CLONE.value
        copied = sorted(
            (i for i, e in enumerate(entries) if e[1] == clone),
            key=lambda i: -entries[i][2].itemsize,
        )
        at = 0
        for i in copied:
            name, kind_, dtype, shape, strides, element, offset, nbytes, _ = entries[i]
            entries[i] = (name, kind_, dtype, shape, strides, element, offset, nbytes, at)
            at += nbytes
        self._copied = tuple((entries[i][6], entries[i][7]) for i in copied)
        """The copied-out tensors' byte ranges in the buffer, in their copy's order."""
        self._entries = tuple(entries)
        self._typed = tuple(typed.items())
        self.in_place = not copied
        """Only views and fresh empties: ``unpack`` runs no device work, so it may run
        before the buffer's bytes landed (``receiving.ChunkedLink.take``)."""

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
        copy = None
        if self._copied:  # one fresh (aligned) allocation for the chunk's misaligned tensors
            copy = torch.cat([buffer[o : o + n] for o, n in self._copied])
        out: list[tuple[str, torch.Tensor]] = []
        append = out.append
        view_kind, clone_kind = _Kind.VIEW.value, _Kind.CLONE.value
        for name, kind, dtype, shape, strides, element, _, nbytes, at in self._entries:
            if kind == view_kind:
                strided, base = views[dtype]
                append((name, strided(shape, strides, base + element)))
            elif kind == clone_kind:
                assert copy is not None
                append((name, copy[at : at + nbytes].view(dtype).view(shape)))
            else:
                append((name, torch.empty(shape, dtype=dtype, device=buffer.device)))
        return out


def unpack_chunk(
    buffer: torch.Tensor, metas: Sequence[ParamMeta], chunk: Chunk, plan: UnpackPlan | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Split a received chunk into ``(name, tensor)`` views of each tensor's dtype/shape.

    ``plan``: this chunk's ``UnpackPlan`` when the caller keeps one (it must have been
    made from the same ``metas`` and ``chunk``); otherwise one is made for this call.
    """
    return (plan if plan is not None else UnpackPlan(metas, chunk)).unpack(buffer)
