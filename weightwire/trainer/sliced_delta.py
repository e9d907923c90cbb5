"""Sliced delta rounds, rank 0's part: each worker gets only the patch elements it serves.

A delta round's patches (``trainer.delta``: per changed tensor ``T`` the flat ``int32``
indices ``T@index`` and the values ``T@values``) are extracted once, as for a broadcast. On
a sliced session each worker then receives, of every patch, only the elements whose
checkpoint coordinates fall in the boxes it wants (``shared.slices.Wants``; a tensor it
wants whole: all of them, one it wants none of: none). Indices stay flat indices into the
whole checkpoint tensor, increasing (the convention the workers' patch path already
applies through its landing map); a worker's ``T@index`` / ``T@values`` are ``[share]``
tensors, the shares told to every worker in the update info (``UpdateInfo.shares``), so
each checks it got exactly its own before anything applies.

The filter runs on the host, vectorised (numpy: the flat indices unravelled once per patch,
one range test per box and dimension): a TCP round copies the patches to the host anyway,
and they are a small part of the model. It runs while the round is set up, before any call:
the shares go in the update POST. So rank 0 holds every worker's share of the patches
(about the patches' bytes times how many workers want each element) until it is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightwire.backends.base import SlicePiece
from weightwire.shared.delta import Patch
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, Wants, split_box

HostBytes = Callable[[Any], np.ndarray]


def inside(coords: Sequence[np.ndarray], boxes: Sequence[Box]) -> np.ndarray:
    """Which elements (their coordinates per dimension, ``np.unravel_index``'s) lie in one of
    ``boxes``."""
    mask = np.zeros(coords[0].shape if coords else (), dtype=bool)
    for box in boxes:
        hit = np.ones_like(mask)
        for c, (lo, hi) in zip(coords, box.ranges, strict=True):
            hit &= (c >= lo) & (c < hi)
        mask |= hit
    return mask


@dataclass
class PatchShares:
    """Every worker's part of a round's patches, filtered and on the host."""

    patches: list[Patch]
    counts: list[list[int]]
    """Per worker, per patch: its elements (``UpdateInfo.shares``)."""
    parts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """``(worker, patch)`` -> its indices (``int32``) and values (their bytes, one row per
    element); absent when its count is 0."""

    @property
    def nbytes(self) -> list[int]:
        """Per worker: the bytes of its share (indices and values)."""
        out = [0] * len(self.counts)
        for (w, _), (index, values) in self.parts.items():
            out[w] += index.nbytes + values.nbytes
        return out

    def pieces(self, metas: Sequence[ParamMeta], buffer_bytes: int) -> dict[int, list[SlicePiece]]:
        """Per wire tensor (its index in ``metas``) of a patch, the pieces of it each worker
        gets: boxes of its ``[share]`` tensor, cut to ``buffer_bytes`` like any piece."""
        position = {m.name: i for i, m in enumerate(metas)}
        out: dict[int, list[SlicePiece]] = {}
        for p, patch in enumerate(self.patches):
            at_index, at_values = position[patch.index_name], position[patch.values_name]
            out[at_index], out[at_values] = [], []
            for w in range(len(self.counts)):
                got = self.parts.get((w, p))
                if got is None:
                    continue
                for at, data, itemsize in (
                    (at_index, got[0], 4),
                    (at_values, got[1], wire_dtype(patch.dtype).itemsize),
                ):
                    for sub in split_box(Box.whole((len(data),)), itemsize, buffer_bytes):
                        out[at].append(SlicePiece(w, at, sub, _cut(data, sub)))
        return out


def _cut(data: np.ndarray, box: Box) -> Callable[[], np.ndarray]:
    ((lo, hi),) = box.ranges
    return lambda: data[lo:hi]


def share_patches(
    patches: Sequence[Patch],
    tensors: Mapping[str, Any],
    wants: Sequence[Wants],
    host_bytes: HostBytes,
) -> PatchShares:
    """Each worker's elements of every patch (module docstring). ``tensors``: the round's
    wire tensors by name; ``host_bytes``: the framework's (a whole wire tensor's bytes on
    the host: the extraction left each patch on one device)."""
    counts = [[0] * len(patches) for _ in wants]
    shares = PatchShares(list(patches), counts)
    for p, patch in enumerate(patches):
        itemsize = wire_dtype(patch.dtype).itemsize
        index = _host(host_bytes(tensors[patch.index_name])).view("<i4")
        values = _host(host_bytes(tensors[patch.values_name])).reshape(patch.nnz, itemsize)
        coords: tuple[np.ndarray, ...] | None = None
        everything = (Box.whole(patch.shape),)
        for w, want in enumerate(wants):
            boxes = want.regions[patch.name]
            if not boxes:
                continue
            if tuple(boxes) == everything:
                mine = (index, values)
            else:
                if coords is None:
                    coords = np.unravel_index(index.astype(np.int64), patch.shape)
                keep = inside(coords, boxes)
                if not keep.any():
                    continue
                mine = (np.ascontiguousarray(index[keep]), np.ascontiguousarray(values[keep]))
            counts[w][p] = len(mine[0])
            shares.parts[(w, p)] = mine
    return shares


def _host(data: Any) -> np.ndarray:
    """A ``host_bytes`` result as a flat byte array."""
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


__all__ = ["PatchShares", "inside", "share_patches"]
