"""What one worker wants of each checkpoint tensor, derived from its landing map.

The landing map (``landing.record_loader_map``) records every copy the model's own loader
makes: a strided view of the checkpoint tensor into a view of a parameter. Each such
source view that vLLM's loaders take (``narrow`` for a tensor-parallel slice, ``select``
/ ``chunk`` for a fused or stacked part, the whole tensor for a replicated one) is a box
of the checkpoint tensor; the worker's wants of the tensor are the union of those boxes,
coalesced. A source view that is not a box (a stepped slice, a flattened span across
rows) is wanted as the whole tensor: more bytes, never a missing element.

A worker whose map is refused (a loader that is not a plain copy) loads through
``load_weights``, which may read any element: it wants every tensor whole and says why
(``Wants.whole_reason``, logged once).

``write_box`` lands one received slice through the map: a worker never assembles a
tensor it wants only part of.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, Shape, SliceError, Wants, union
from weightwire.torch_side.worker.landing import (
    Landing,
    LoaderMap,
    LoaderMapRefused,
    record_loader_map,
)

if TYPE_CHECKING:
    from weightwire.torch_side.worker.target_caches import TargetCaches

log = logging.getLogger(__name__)


def landing_box(shape: Shape, ld: Landing) -> Box | None:
    """The box of the checkpoint tensor (contiguous, ``shape``) that ``ld`` reads, or None
    when its source view is not a box. Each view dimension of size > 1 must step by one
    along its own checkpoint dimension (stride equal to that dimension's contiguous
    stride) and stay inside it from the offset's coordinate."""
    placed = _placed(shape, ld)
    return placed[0] if placed is not None else None


def _placed(shape: Shape, ld: Landing) -> tuple[Box, list[int | None]] | None:
    """``landing_box`` and, per view dimension, the checkpoint dimension it steps along
    (None for a view dimension of size 1)."""
    if ld.numel == 0:
        return None
    contiguous = _contiguous_strides(shape)
    origin, rest = [], ld.src_offset
    for stride in contiguous:
        origin.append(rest // stride)
        rest %= stride
    ranges = [(o, o + 1) for o in origin]
    dims: list[int | None] = []
    for n, step in zip(ld.shape, ld.src_strides, strict=True):
        if n == 1:
            dims.append(None)
            continue
        dim = next((d for d in range(len(shape)) if shape[d] > 1 and contiguous[d] == step), None)
        if dim is None or dim in dims or origin[dim] + n > shape[dim]:
            return None
        dims.append(dim)
        ranges[dim] = (origin[dim], origin[dim] + n)
    return Box(tuple(ranges)), dims


def _contiguous_strides(shape: Shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return strides[::-1]


def wants_from_map(lmap: LoaderMap, metas: Sequence[ParamMeta]) -> Wants:
    """Per tensor of ``metas``, the union of the boxes its landings read (nothing for a
    tensor no parameter of this worker takes, e.g. another rank's experts)."""
    regions: dict[str, tuple[Box, ...]] = {}
    for m in metas:
        shape = tuple(m.shape)
        tl = lmap.tensors.get(m.name)
        landings = tl.landings if tl is not None else ()
        boxes = [landing_box(shape, ld) for ld in landings if ld.numel > 0]
        if any(b is None for b in boxes):
            regions[m.name] = (Box.whole(shape),)  # a view that is not a box: all of it
        else:
            regions[m.name] = union(b for b in boxes if b is not None)
    return Wants(regions)


def derive_wants(
    model: torch.nn.Module, metas: Sequence[ParamMeta], *, check_post_load: bool = True
) -> Wants:
    """The wants of a worker serving ``model``: from its landing map, or every tensor
    whole when the map is refused (one WARNING names why; the reason travels in the
    wants)."""
    try:
        lmap = record_loader_map(model, metas, check_post_load=check_post_load)
    except LoaderMapRefused as exc:
        log.warning("no landing map, this worker wants every tensor whole: %s", exc)
        return Wants.whole({m.name: tuple(m.shape) for m in metas}, str(exc))
    return wants_from_map(lmap, metas)


def write_box(lmap: LoaderMap, name: str, box: Box, piece: torch.Tensor) -> None:
    """A received slice (``box`` of checkpoint tensor ``name``, ``piece`` of its shape)
    into the parameters: per landing, the part of the box it reads, one ``copy_`` into the
    matching part of its parameter view (exactly what ``load_weights`` of the full tensor
    copies there). Raises ``SliceError`` when a landing of the tensor does not read a box
    (the worker wanted it whole: assemble it, then ``LoaderMap.write``)."""
    tl = lmap.tensors[name]
    if tuple(piece.shape) != box.shape or not box.within(tl.shape):
        raise SliceError(
            f"{name}: a {list(piece.shape)} piece for box {box.describe()} of a "
            f"{list(tl.shape)} tensor"
        )
    with torch.no_grad():
        for ld in tl.landings:
            placed = _placed(tl.shape, ld)
            if placed is None:
                raise SliceError(
                    f"{name}: its loader reads a view that is not a box; assemble the whole "
                    "tensor and write it with LoaderMap.write"
                )
            read, dims = placed
            common = read.intersect(box)
            if common is None:
                continue
            dst = lmap.params[ld.param].as_strided(ld.shape, ld.dst_strides, ld.dst_offset)
            for i, d in enumerate(dims):
                if d is not None:
                    (lo, hi), (rlo, _) = common.ranges[d], read.ranges[d]
                    dst = dst.narrow(i, lo - rlo, hi - lo)
            stepped = [d for d in dims if d is not None]
            order = stepped + [d for d in range(len(tl.shape)) if d not in stepped]
            part = piece[common.relative_to(box).slices()].permute(*order)
            dst.copy_(part.reshape(dst.shape))
        for f in tl.fills:
            lmap.params[f.param].as_strided(f.shape, f.dst_strides, f.dst_offset).fill_(f.value)


def session_wants(caches: TargetCaches, metas: Sequence[ParamMeta]) -> Wants:
    """The wants a worker sends in its hello, from the landing map its caches record once
    per model and metadata (the same map its rounds write through). A model refused only for
    its post-load processing (a CPU vLLM's prepack) still wants what its loader reads (the
    map recorded without that check: its rounds then go through ``load_weights``, which
    reads nothing else); every tensor whole, with the refusal (logged once by the caches),
    when its loading itself is no plain copy."""
    lmap = caches.loader_map(metas)
    if lmap is not None:
        return wants_from_map(lmap, metas)
    try:
        reads = caches.reads_map(metas)
    except LoaderMapRefused as exc:  # the loading itself: the same reason the caches logged
        return Wants.whole({m.name: tuple(m.shape) for m in metas}, str(exc))
    return wants_from_map(reads, metas)


__all__ = ["derive_wants", "landing_box", "session_wants", "wants_from_map", "write_box"]
