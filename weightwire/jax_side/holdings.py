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

import jax
import numpy as np

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


__all__ = ["array_holdings", "cut_box", "holdings_of", "index_box", "process_rank", "read_box"]
