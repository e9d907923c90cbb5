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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, Shape, Wants, union
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
    if ld.numel == 0:
        return None
    contiguous = _contiguous_strides(shape)
    origin, rest = [], ld.src_offset
    for stride in contiguous:
        origin.append(rest // stride)
        rest %= stride
    ranges = [(o, o + 1) for o in origin]
    used: set[int] = set()
    for n, step in zip(ld.shape, ld.src_strides, strict=True):
        if n == 1:
            continue
        dim = next((d for d in range(len(shape)) if shape[d] > 1 and contiguous[d] == step), None)
        if dim is None or dim in used or origin[dim] + n > shape[dim]:
            return None
        used.add(dim)
        ranges[dim] = (origin[dim], origin[dim] + n)
    return Box(tuple(ranges))


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


def session_wants(caches: TargetCaches, metas: Sequence[ParamMeta]) -> Wants:
    """The wants a worker sends in its hello, from the landing map its caches record once
    per model and metadata (the same map its rounds write through); every tensor whole,
    with the caches' refusal (logged once there), when the model refuses."""
    lmap = caches.loader_map(metas)
    if lmap is None:
        reason = caches.map_refusal(metas) or "no landing map"
        return Wants.whole({m.name: tuple(m.shape) for m in metas}, reason)
    return wants_from_map(lmap, metas)


__all__ = ["derive_wants", "landing_box", "session_wants", "wants_from_map"]
