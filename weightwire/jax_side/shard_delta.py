"""Delta rounds from sharded ``jax.Array`` s, shard by shard: no array is ever gathered.

A sharded array's patch is found where its shards live (issue #48's "no full gather"). The
base is a copy of the array with the same sharding (``JaxDeltaKernel.snapshot``: a copy of
the addressable shards, never gathered). Each distinct box of the sharding is one *part*:
the first addressable shard holding it is compared with the base's shard on the same device
(``delta._scan_group``, one jitted call per device for a group's parts), so a box several
devices replicate is scanned and extracted once. A part that changed is compacted by the
same kernel as a whole array (``delta._expand_search``: indices in the shard's own flat
coordinates), then the indices are moved to the whole tensor's coordinates (unravelled in
the shard's shape, offset by its box's origin, ravelled in the array's), on the shard's
device. The base's replicas of that box take the same local patch (a scatter: only the
patch crosses to their devices).

The parts' patches are then merged on the device of the first changed part: only patch
elements move (at most the tensor's ``limit``, what the round sends anyway), concatenated and
sorted by index (one ``lax.sort``), so the patch is the whole-tensor extraction's bit for
bit: the same strictly increasing flat indices (the wire's rule), the same values. A single
changed part needs no merge (a box's row-major order is the array's restricted to it).

A layout the parts cannot cover (a base with another sharding than the new array, boxes
that overlap without being equal) counts every element as changed: the tensor goes dense
this round and its base is re-copied in the new layout, still without a gather.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from weightwire.jax_side.holdings import index_box
from weightwire.shared.slices import Box


def is_sharded(x: Any) -> bool:
    """An array this process holds in several device shards, each of which it can read."""
    return isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 and x.is_fully_addressable


@dataclass(frozen=True)
class Part:
    """One distinct box of a sharded array: the new and base shards of one device holding
    it, and the base's shards of the other devices holding it too (replicas)."""

    box: Box
    new: jax.Array
    base: jax.Array
    replicas: tuple[jax.Array, ...]

    @property
    def device(self) -> Any:
        return next(iter(self.new.devices()))


def parts_of(new: jax.Array, base: Any) -> list[Part] | None:
    """``new``'s distinct boxes, each with its base shards, in box order; ``None`` where the
    base is not laid out as ``new`` or the boxes do not tile the array (see the module)."""
    if not (is_sharded(base) and base.shape == new.shape and base.dtype == new.dtype):
        return None
    shape = tuple(new.shape)
    if new.sharding.devices_indices_map(shape) != base.sharding.devices_indices_map(shape):
        return None
    bases = {s.device: s.data for s in base.addressable_shards}
    boxes: dict[Box, list[tuple[jax.Array, jax.Array]]] = {}
    for shard in new.addressable_shards:
        box = index_box(shard.index, shape)
        boxes.setdefault(box, []).append((shard.data, bases[shard.device]))
    if sum(b.volume for b in boxes) != math.prod(shape):
        return None  # overlapping boxes: a layout the parts cannot split
    out = []
    for box in sorted(boxes, key=lambda b: b.ranges):
        (first_new, first_base), *rest = boxes[box]
        out.append(Part(box, first_new, first_base, tuple(b for _, b in rest)))
    return out


@dataclass
class ShardedScan:
    """One sharded array's parts and, per part, its mask words and changed count."""

    parts: list[Part]
    words: list[Any]
    counts: list[int]


@functools.partial(jax.jit, static_argnames=("local", "whole"))
def _to_whole(index: jax.Array, origin: jax.Array, local: tuple[int, ...], whole: tuple[int, ...]):
    """Flat indices in a shard of shape ``local`` -> flat indices of the array of shape
    ``whole``, the shard's box starting at ``origin``; a fill slot (``>=`` the shard's size)
    becomes the array's size, which sorts after every real index."""
    size = math.prod(local)
    flat = jnp.zeros_like(index)
    rest = index
    stride_local = size
    for d, (n_local, n_whole) in enumerate(zip(local, whole, strict=True)):
        stride_local //= max(n_local, 1)
        coord = rest // max(stride_local, 1)
        rest = rest - coord * stride_local
        flat = flat * n_whole + coord + origin[d]
    return jnp.where(index < size, flat, math.prod(whole)).astype(jnp.int32)


@functools.lru_cache(maxsize=4096)
def _origin(device: Any, origin: tuple[int, ...]) -> jax.Array:
    """A box's origin on its device, made once (a transfer per part and round costs more
    than the part's kernels)."""
    return jax.device_put(np.asarray(origin, np.int32), device)


@jax.jit
def _apply(base: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """A replica's base with a part's local patch written (fill slots dropped)."""
    return base.reshape(-1).at[index].set(values, mode="drop").reshape(base.shape)


@jax.jit
def _merge(indices: list[jax.Array], values: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The parts' patches as one, by increasing index (fill slots last)."""
    index, vals = lax.sort((jnp.concatenate(indices), jnp.concatenate(values)), num_keys=1)
    return index, vals


def scan_parts(groups: Sequence[tuple[int, list[Part]]], scan_group: Any) -> dict[int, ShardedScan]:
    """Each sharded tensor's parts compared with their bases: one ``scan_group`` call per
    device over every part it holds (dispatched before any count is read), then one read of
    the counts."""
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for i, parts in groups:
        for k, part in enumerate(parts):
            by_device.setdefault(part.device, []).append((i, k))
    out = {i: ShardedScan(parts, [None] * len(parts), [0] * len(parts)) for i, parts in groups}
    launched = []
    for keys in by_device.values():
        parts = [out[i].parts[k] for i, k in keys]
        words, counts = scan_group([p.new for p in parts], [p.base for p in parts])
        launched.append((keys, words, counts))
    for keys, words, counts in launched:
        for (i, k), w, c in zip(keys, words, np.asarray(counts), strict=True):
            out[i].words[k] = w
            out[i].counts[k] = int(c)
    return out


def extract_parts(
    scan: ShardedScan, base: jax.Array, expand: Any, bucket: Any
) -> tuple[jax.Array, jax.Array, int, jax.Array]:
    """The sharded tensor's patch (bucketed index and values arrays, their count) in whole-
    tensor coordinates, and its base with the patch written, sharded as it was."""
    shape = tuple(base.shape)
    pieces: list[tuple[jax.Array, jax.Array, int]] = []
    patched: dict[Any, jax.Array] = {}
    for part, words, count in zip(scan.parts, scan.words, scan.counts, strict=True):
        if not count:
            continue
        local, values, written = expand(part.new, part.base, words, size=bucket(count))
        patched[part.device] = written
        if part.replicas:  # one batched transfer of the local patch to every replica's device
            devices = [next(iter(r.devices())) for r in part.replicas]
            moved = jax.device_put([(local, values)] * len(devices), devices)
            for device, replica, at in zip(devices, part.replicas, moved, strict=True):
                patched[device] = _apply(replica, *at)
        origin = _origin(part.device, part.box.origin)
        pieces.append((_to_whole(local, origin, part.box.shape, shape), values, count))
    shards = [patched.get(s.device, s.data) for s in base.addressable_shards]
    rebuilt = jax.make_array_from_single_device_arrays(shape, base.sharding, shards)
    total = sum(c for _, _, c in pieces)
    if len(pieces) == 1:
        index, values, _ = pieces[0]
        return index, values, total, rebuilt
    home = next(iter(pieces[0][0].devices()))
    indices, values = jax.device_put(([i for i, _, _ in pieces], [v for _, v, _ in pieces]), home)
    index, values = _merge(indices, values)
    return index, values, total, rebuilt


def first_of(base: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Element 0 of a sharded ``base`` and its index, from the shard holding it."""
    shape = tuple(base.shape)
    for shard in base.addressable_shards:
        if all(lo == 0 for lo in index_box(shard.index, shape).origin):
            (device,) = shard.data.devices()
            index = jax.device_put(np.zeros((1,), np.int32), device)
            return index, shard.data.reshape(-1)[:1]
    raise AssertionError("no shard of a fully addressable array holds its element 0")


def held_bytes(array: jax.Array) -> int:
    """Device bytes of this process's shards of ``array`` (replicas counted each)."""
    return sum(s.data.nbytes for s in array.addressable_shards)


__all__ = [
    "Part",
    "ShardedScan",
    "extract_parts",
    "first_of",
    "held_bytes",
    "is_sharded",
    "parts_of",
    "scan_parts",
]
