"""What each trainer rank holds of sharded ``jax.Array`` s, and a held slice's bytes.

``array_holdings`` reads a global array's sharding (``devices_indices_map``: metadata
every process has, for every device, addressable or not) and never touches its data: the
slice plan (``trainer.slice_plan``) is built from it without a gather. A rank is by
default the device's process (``jax.distributed``: one sender per process); a test on one
host may count each device as a rank.

``read_box`` takes a planned slice from one addressable shard that holds it: the slice
is cut on the shard's device and only its elements reach the host, so no process ever
materialises a tensor it does not hold whole (``jax_side.placement`` gathers; this does
not).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from weightwire.backends.base import LocalShards
from weightwire.shared.errors import ConfigError, SourceMismatch
from weightwire.shared.slices import Box, Shape
from weightwire.trainer.slice_plan import Held, Holdings, SlicePlanError

RankOf = Callable[[jax.Device], int]


def process_rank(device: jax.Device) -> int:
    return int(device.process_index)


def index_box(index: Sequence[slice], shape: Shape) -> Box:
    """A shard's index (one slice per dimension, as ``devices_indices_map`` and
    ``Shard.index`` give it) as a box of the global array."""
    ranges = []
    for s, n in zip(index, shape, strict=True):
        lo, hi, step = s.indices(n)
        if step != 1:
            raise SlicePlanError(f"a shard index steps by {step}; only contiguous shards are held")
        ranges.append((lo, max(lo, hi)))
    return Box(tuple(ranges))


def array_holdings(name: str, array: jax.Array, *, rank_of: RankOf = process_rank) -> list[Held]:
    """One ``Held`` per (rank, distinct box) of ``array`` (several devices of one rank
    holding the same replica count once)."""
    shape = tuple(array.shape)
    seen: dict[tuple[int, Box], None] = {}
    for device, index in array.sharding.devices_indices_map(shape).items():
        seen.setdefault((rank_of(device), index_box(index, shape)), None)
    return [Held(name, rank, box) for rank, box in sorted(seen, key=lambda k: (k[0], k[1].ranges))]


def holdings_of(arrays: Mapping[str, jax.Array], *, rank_of: RankOf = process_rank) -> Holdings:
    """Every rank's boxes of every array (metadata only: no data moves)."""
    held = [h for name, a in arrays.items() for h in array_holdings(name, a, rank_of=rank_of)]
    return Holdings.of({n: tuple(a.shape) for n, a in arrays.items()}, held)


def read_box(
    array: jax.Array, box: Box, *, rank: int | None = None, rank_of: RankOf = process_rank
) -> np.ndarray:
    """``box`` of ``array`` as a host array, taken from the first addressable shard that
    holds all of it (one of ``rank``'s devices when given). Only the box's elements
    leave the device."""
    return np.asarray(jax.device_get(cut_box(array, box, rank=rank, rank_of=rank_of)))


def cut_box(
    array: jax.Array, box: Box, *, rank: int | None = None, rank_of: RankOf = process_rank
) -> jax.Array:
    """``box`` of ``array`` as an array on the device of the first addressable shard that
    holds all of it (one of ``rank``'s devices when given), cut there."""
    shape = tuple(array.shape)
    for shard in array.addressable_shards:
        if rank is not None and rank_of(shard.device) != rank:
            continue
        held = index_box(shard.index, shape)
        if held.contains(box):
            # a whole shard: no slicing op to dispatch
            return shard.data if held == box else shard.data[box.relative_to(held).slices()]
    where = f"rank {rank}'s" if rank is not None else "this process's"
    raise SlicePlanError(
        f"no shard on {where} devices holds box {box.describe()} of an array of shape "
        f"{list(shape)}: the plan was built from other holdings than these arrays'"
    )


def _mesh_devices(array: jax.Array) -> list[jax.Device]:
    """The devices of ``array``'s sharding in rank order: a ``NamedSharding``'s mesh
    row-major, else by device id."""
    mesh = getattr(array.sharding, "mesh", None)
    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return list(np.asarray(devices).flat)
    return sorted(array.sharding.device_set, key=lambda d: d.id)


class JaxLocalShards(LocalShards):
    """A JAX trainer's devices as trainer ranks of this process (``SenderCaps.local_shards``):
    rank r is ``devices[r]``, the mesh of the first sharded array (row-major), and each rank's
    part of an array is the addressable shard its device holds (a view: nothing gathered). A
    host array is held whole by every rank (put on each device per round)."""

    def __init__(self, devices: Sequence[jax.Device]) -> None:
        self._jax_devices = list(devices)

    @classmethod
    def of(cls, arrays: Mapping[str, object], device: int | None) -> JaxLocalShards:
        """The ranks of the first ``jax.Array`` among ``arrays`` (else one: the local
        device ``device``, or the first)."""
        for tensor in arrays.values():
            if isinstance(tensor, jax.Array):
                return cls(_mesh_devices(tensor))
        local = jax.local_devices()
        return cls([local[device or 0]])

    @property
    def devices(self) -> list[int]:
        out = []
        for d in self._jax_devices:
            hw = getattr(d, "local_hardware_id", None)
            out.append(int(d.id if hw is None else hw))
        return out

    def boxes(self, name: str, tensor: Any) -> list[Box]:
        shape = tuple(int(n) for n in np.shape(tensor))
        if not isinstance(tensor, jax.Array):
            return [Box.whole(shape)] * len(self._jax_devices)
        index_map = tensor.sharding.devices_indices_map(shape)
        missing = [r for r, d in enumerate(self._jax_devices) if d not in index_map]
        if missing:
            r = missing[0]
            raise ConfigError(
                f"'{name}' is not placed on trainer rank {r}'s device {self._jax_devices[r]}: "
                f"every tensor must be on each of the trainer ranks' {len(self._jax_devices)} "
                "devices (the first sharded array's mesh), whole or split"
            )
        return [index_box(index_map[d], shape) for d in self._jax_devices]

    def shards(self, name: str, tensor: Any) -> list[Any]:
        if not isinstance(tensor, jax.Array):
            return [jax.device_put(tensor, d) for d in self._jax_devices]
        by_device = {s.device: s.data for s in tensor.addressable_shards}
        parts = []
        for d in self._jax_devices:
            part = by_device.get(d)
            if part is None:
                raise SourceMismatch(
                    f"'{name}' has no shard on device {d} of this process (its sharding "
                    "changed since the session opened: shutdown() and trainer_init() again)"
                )
            parts.append(part)
        for part in parts:
            part.block_until_ready()  # nccl.m2n reads on its own stream: XLA's writes first
        return parts


__all__ = [
    "JaxLocalShards",
    "array_holdings",
    "cut_box",
    "holdings_of",
    "index_box",
    "process_rank",
    "read_box",
]
