"""Slices of checkpoint tensors: what a worker wants, what a trainer rank holds.

A ``Box`` is a region of one tensor given per dimension by a half-open range ``[lo, hi)``;
a wanted region is a small union of disjoint boxes (fused qkv with fewer KV heads than
tensor-parallel ranks gives a worker its q rows plus the k/v rows of its KV head). Regions
are always described this way, never as index lists, so a hello stays a few hundred bytes
whatever the model's size.

``Wants`` is one worker's region of every checkpoint tensor, with a JSON form whose parse
checks everything (known names, in range, non-empty and disjoint boxes) before a plan is
built from it. numpy-free: plain ints only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightwire.shared.errors import ConfigError

Shape = tuple[int, ...]


class SliceError(ConfigError):
    """A box or a worker's wants that do not describe a part of the declared tensors."""


@dataclass(frozen=True)
class Box:
    """Per dimension a half-open range ``[lo, hi)`` of one tensor's elements."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls(tuple((0, int(n)) for n in shape))

    @classmethod
    def of(cls, *ranges: tuple[int, int]) -> Box:
        return cls(tuple((int(lo), int(hi)) for lo, hi in ranges))

    @property
    def ndim(self) -> int:
        return len(self.ranges)

    @property
    def shape(self) -> Shape:
        return tuple(max(0, hi - lo) for lo, hi in self.ranges)

    @property
    def volume(self) -> int:
        """Elements inside (0 for an empty box; 1 for the box of a scalar)."""
        return math.prod(self.shape)

    @property
    def empty(self) -> bool:
        return any(hi <= lo for lo, hi in self.ranges)

    @property
    def origin(self) -> Shape:
        return tuple(lo for lo, _ in self.ranges)

    def slices(self) -> tuple[slice, ...]:
        """The box as an indexing tuple (``array[box.slices()]``)."""
        return tuple(slice(lo, hi) for lo, hi in self.ranges)

    def within(self, shape: Sequence[int]) -> bool:
        """Inside a tensor of ``shape`` (same rank, ``0 <= lo <= hi <= n``)."""
        return len(shape) == self.ndim and all(
            0 <= lo <= hi <= n for (lo, hi), n in zip(self.ranges, shape, strict=True)
        )

    def contains(self, other: Box) -> bool:
        """Every element of ``other`` is inside this box (an empty ``other`` always is)."""
        self._same_rank(other)
        if other.empty:
            return True
        return all(
            lo <= olo and ohi <= hi
            for (lo, hi), (olo, ohi) in zip(self.ranges, other.ranges, strict=True)
        )

    def intersect(self, other: Box) -> Box | None:
        """The common elements, or None when there are none."""
        self._same_rank(other)
        out = []
        for (lo, hi), (olo, ohi) in zip(self.ranges, other.ranges, strict=True):
            lo, hi = max(lo, olo), min(hi, ohi)
            if hi <= lo:
                return None
            out.append((lo, hi))
        return Box(tuple(out))

    def minus(self, other: Box) -> tuple[Box, ...]:
        """This box without ``other``'s elements, as at most ``2 * ndim`` disjoint boxes (cut
        dimension by dimension: below and above the overlap, then the overlap's range)."""
        common = self.intersect(other)
        if common is None:
            return () if self.empty else (self,)
        pieces: list[Box] = []
        rest = list(self.ranges)
        for d, ((lo, hi), (clo, chi)) in enumerate(zip(self.ranges, common.ranges, strict=True)):
            if lo < clo:
                pieces.append(Box((*rest[:d], (lo, clo), *rest[d + 1 :])))
            if chi < hi:
                pieces.append(Box((*rest[:d], (chi, hi), *rest[d + 1 :])))
            rest[d] = (clo, chi)
        return tuple(pieces)

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it): what to index a
        shard holding ``outer`` with."""
        if not outer.contains(self):
            raise SliceError(f"box {self.describe()} is not inside {outer.describe()}")
        return Box(
            tuple(
                (lo - olo, hi - olo)
                for (lo, hi), (olo, _) in zip(self.ranges, outer.ranges, strict=True)
            )
        )

    def describe(self) -> str:
        return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in self.ranges) + "]"

    def _same_rank(self, other: Box) -> None:
        if other.ndim != self.ndim:
            raise SliceError(f"boxes {self.describe()} and {other.describe()} have different ranks")


def volume(boxes: Iterable[Box]) -> int:
    """Elements in a union of DISJOINT boxes."""
    return sum(b.volume for b in boxes)


def first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two boxes of ``boxes`` that share an element, or None when all are disjoint."""
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if a.intersect(b) is not None:
                return a, b
    return None


def union(boxes: Iterable[Box]) -> tuple[Box, ...]:
    """The elements of ``boxes`` (which may overlap) as disjoint boxes, neighbours that
    differ in one range only merged (a tensor-parallel slice recorded as several copies
    becomes one box again). Deterministic: sorted by origin."""
    disjoint: list[Box] = []
    for box in boxes:
        if box.empty:
            continue
        pieces = [box]
        for held in disjoint:
            pieces = [p for piece in pieces for p in piece.minus(held)]
        disjoint.extend(pieces)
    return tuple(sorted(_coalesce(disjoint), key=lambda b: b.ranges))


def split_box(box: Box, itemsize: int, max_bytes: int) -> Iterator[Box]:
    """``box`` cut along its first dimension into boxes of at most ``max_bytes`` (one row of
    that dimension at least: a row larger than the buffer goes whole)."""
    if box.ndim == 0 or box.volume * itemsize <= max_bytes:
        yield box
        return
    (lo, hi), rest = box.ranges[0], box.ranges[1:]
    row = max(1, box.volume // max(1, hi - lo)) * itemsize
    step = max(1, max_bytes // row)
    for start in range(lo, hi, step):
        yield Box(((start, min(hi, start + step)), *rest))


def _coalesce(boxes: list[Box]) -> list[Box]:
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(boxes):
            for j in range(i + 1, len(boxes)):
                joined = _join(a, boxes[j])
                if joined is not None:
                    boxes = [b for k, b in enumerate(boxes) if k not in (i, j)] + [joined]
                    merged = True
                    break
            if merged:
                break
    return boxes


def _join(a: Box, b: Box) -> Box | None:
    """``a`` and ``b`` as one box, when they are adjacent along one dimension and equal in
    all others."""
    differ = [d for d in range(a.ndim) if a.ranges[d] != b.ranges[d]]
    if len(differ) != 1:
        return None
    d = differ[0]
    (alo, ahi), (blo, bhi) = a.ranges[d], b.ranges[d]
    if ahi == blo or bhi == alo:
        return Box((*a.ranges[:d], (min(alo, blo), max(ahi, bhi)), *a.ranges[d + 1 :]))
    return None


@dataclass(frozen=True)
class Wants:
    """The part of every checkpoint tensor one worker reads: name -> disjoint boxes (empty:
    none of it lives on the worker). ``whole_reason`` is set when the worker could not
    narrow its wants (its landing map was refused) and wants every tensor whole."""

    regions: Mapping[str, tuple[Box, ...]]
    whole_reason: str | None = None

    @classmethod
    def whole(cls, shapes: Mapping[str, Sequence[int]], reason: str) -> Wants:
        return cls({n: (Box.whole(s),) for n, s in shapes.items()}, reason)

    def volume(self, name: str) -> int:
        return volume(self.regions[name])

    def to_json(self) -> dict[str, Any]:
        """Each tensor as a list of boxes, each box a list of ``[lo, hi]`` per dimension."""
        return {
            "tensors": {
                n: [[list(r) for r in b.ranges] for b in bs] for n, bs in self.regions.items()
            },
            "whole_reason": self.whole_reason,
        }

    @classmethod
    def from_json(cls, obj: Any, shapes: Mapping[str, Sequence[int]]) -> Wants:
        """Parse and check a worker's wants against the session's tensors: every declared
        tensor appears, no unknown one; every box has the tensor's rank, is non-empty, lies
        inside it, and no two boxes of one tensor overlap."""
        if not isinstance(obj, dict) or set(obj) != {"tensors", "whole_reason"}:
            raise SliceError(
                "wants must be an object with exactly 'tensors' and 'whole_reason', got "
                f"{_short(obj)}"
            )
        reason, tensors = obj["whole_reason"], obj["tensors"]
        if reason is not None and not isinstance(reason, str):
            raise SliceError(f"wants: whole_reason must be a string or null, got {_short(reason)}")
        if not isinstance(tensors, dict):
            raise SliceError(f"wants: 'tensors' must be an object, got {_short(tensors)}")
        unknown = sorted(set(tensors) - set(shapes))
        if unknown:
            raise SliceError(
                f"wants name {len(unknown)} tensor(s) the session did not declare, first "
                f"{unknown[0]!r}: the worker's metadata differs from the trainer's"
            )
        missing = [n for n in shapes if n not in tensors]
        if missing:
            raise SliceError(
                f"wants leave out {len(missing)} declared tensor(s), first {missing[0]!r}: "
                "a worker names every tensor (an empty list when it holds none of it)"
            )
        regions = {n: _parse_boxes(n, tensors[n], tuple(shapes[n])) for n in shapes}
        return cls(regions, reason)


def _parse_boxes(name: str, raw: Any, shape: Shape) -> tuple[Box, ...]:
    if not isinstance(raw, list):
        raise SliceError(f"wants of {name!r}: a list of boxes, got {_short(raw)}")
    boxes = []
    for item in raw:
        ok = (
            isinstance(item, list)
            and len(item) == len(shape)
            and all(
                isinstance(r, list)
                and len(r) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
                for r in item
            )
        )
        if not ok:
            raise SliceError(
                f"wants of {name!r}: a box is a list of {len(shape)} [lo, hi] integer pairs "
                f"(the tensor's rank), got {_short(item)}"
            )
        box = Box(tuple((r[0], r[1]) for r in item))
        if not box.within(shape) or box.empty:
            raise SliceError(
                f"wants of {name!r}: box {box.describe()} is empty or outside the tensor's "
                f"shape {list(shape)}"
            )
        boxes.append(box)
    overlap = first_overlap(boxes)
    if overlap is not None:
        raise SliceError(
            f"wants of {name!r}: boxes {overlap[0].describe()} and {overlap[1].describe()} "
            "overlap (each element is wanted once)"
        )
    return tuple(boxes)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = [
    "Box",
    "Shape",
    "SliceError",
    "Wants",
    "first_overlap",
    "split_box",
    "union",
    "volume",
]
