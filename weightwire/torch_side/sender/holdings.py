"""What each trainer rank holds of a torch trainer's tensors, for the slice plan.

A plain tensor is held whole by the rank that has it. A DTensor (FSDP2's and TP's
parameters) is held per its placements over its device mesh: ``Shard(d)`` splits
dimension ``d`` as ``torch.chunk`` does (chunks of ``ceil(n / k)``, the last ones shorter
or empty), several shards of one dimension applied in mesh-dimension order, and
``Replicate`` keeps the whole range on every rank of that mesh dimension. The boxes of
every rank follow from the mesh and placements alone: no data moves. ``Partial`` (a
pending reduction) and strided shards (FSDP2 over TP re-sharding one dimension) are not
held slices: refused by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightwire.backends.base import LocalShards
from weightwire.shared.errors import ConfigError, SourceMismatch
from weightwire.shared.slices import Box, Shape
from weightwire.trainer.slice_plan import Held, Holdings, SlicePlanError


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def placement_boxes(
    shape: Shape, mesh: Sequence[Any] | Any, placements: Sequence[Any], *, name: str = "tensor"
) -> list[tuple[int, Box]]:
    """(global rank, box) for every rank of ``mesh`` (a nested list / array / tensor of
    global ranks, one dimension per placement)."""
    grid = torch.as_tensor(mesh)
    if grid.dim() != len(placements):
        raise SlicePlanError(
            f"{name}: {len(placements)} placements for a {grid.dim()}-dimensional mesh"
        )
    out = []
    for coord in itertools.product(*(range(n) for n in grid.shape)):
        ranges = [(0, n) for n in shape]
        for mesh_dim, p in enumerate(placements):
            kind = type(p).__name__
            if kind == "Replicate":
                continue
            if kind != "Shard":
                raise SlicePlanError(
                    f"{name}: placement {p} is not a held slice (only Shard and Replicate "
                    "are): redistribute the DTensor to Shard / Replicate placements first"
                )
            dim = p.dim % len(shape)
            lo, hi = ranges[dim]
            k = int(grid.shape[mesh_dim])
            chunk = -(-(hi - lo) // k)
            start = min(lo + coord[mesh_dim] * chunk, hi)
            ranges[dim] = (start, min(start + chunk, hi))
        out.append((int(grid[coord]), Box(tuple(ranges))))
    return out


def tensor_holdings(name: str, tensor: torch.Tensor, *, rank: int) -> list[Held]:
    """A DTensor's boxes on every rank of its mesh; a plain tensor whole on ``rank``."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        spread: Any = tensor  # a DTensor (not in torch's stubs' Tensor)
        boxes = placement_boxes(
            tuple(spread.shape), spread.device_mesh.mesh, spread.placements, name=name
        )
        return [Held(name, r, b) for r, b in boxes if not b.empty]
    return [Held(name, rank, Box.whole(tuple(tensor.shape)))]


def holdings_of(tensors: Mapping[str, torch.Tensor], *, rank: int) -> Holdings:
    """Holdings of a trainer's tensors as rank ``rank`` sees them. DTensors describe every
    rank; plain tensors only this one (gather the ranks' plain holdings to plan across
    ranks that each hold different whole tensors)."""
    held = [h for n, t in tensors.items() for h in tensor_holdings(n, t, rank=rank)]
    return Holdings.of({n: tuple(t.shape) for n, t in tensors.items()}, held)


def local_piece(tensor: torch.Tensor, box: Box, *, rank: int) -> torch.Tensor:
    """``box`` of ``tensor`` as a view of what ``rank`` holds: a DTensor's local shard (its
    box on this rank must contain ``box``), a plain tensor itself. Nothing is gathered."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        spread: Any = tensor
        mine = [
            b
            for r, b in placement_boxes(
                tuple(spread.shape), spread.device_mesh.mesh, spread.placements
            )
            if r == rank
        ]
        if not mine or not mine[0].contains(box):
            raise SlicePlanError(
                f"rank {rank}'s shard does not hold box {box.describe()} of a DTensor of "
                f"shape {list(spread.shape)}: the plan was built from other holdings"
            )
        local: torch.Tensor = spread.to_local()
        return local[box.relative_to(mine[0]).slices()]
    return tensor[box.slices()]


class TorchLocalShards(LocalShards):
    """A torch trainer as trainer ranks of this process (``SenderCaps.local_shards``): one
    rank, the device holding every tensor whole. A DTensor is refused by name: its other
    shards live in other processes, and such a backend's ranks are all devices of this one."""

    def __init__(self, device: int) -> None:
        self._device = device

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], device: int | None) -> TorchLocalShards:
        """The rank on the first CUDA tensor's device (else ``device``, or 0), every tensor
        of ``tensors`` checked."""
        ordinal = next(
            (int(t.device.index or 0) for t in tensors.values() if t.is_cuda),
            0 if device is None else device,
        )
        local = cls(ordinal)
        for name, tensor in tensors.items():
            local._check(name, tensor)
        return local

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(tensor, dtensor):
            raise ConfigError(
                f"'{name}' is a DTensor: its shards are held by other trainer processes, "
                "and this backend's trainer ranks are the devices of the one process that "
                "sends (send plain tensors, e.g. full_tensor() per round on this rank, "
                "or use a backend with sliced rounds, which read DTensor shards)"
            )
        if tensor.is_cuda and tensor.device.index != self._device:
            raise SourceMismatch(
                f"'{name}' is on {tensor.device}, the session sends from cuda:{self._device}: "
                "a torch trainer sends from one device, which holds every tensor whole"
            )

    @property
    def devices(self) -> list[int]:
        return [self._device]

    def boxes(self, name: str, tensor: Any) -> list[Box]:
        self._check(name, tensor)
        return [Box.whole(tuple(tensor.shape))]

    def shards(self, name: str, tensor: Any) -> list[Any]:
        self._check(name, tensor)
        if tensor.is_cuda:
            # the data plane reads on its own stream: the trainer's writes must be done
            torch.cuda.current_stream(tensor.device).synchronize()
        return [tensor.detach().contiguous()]


__all__ = [
    "TorchLocalShards",
    "holdings_of",
    "local_piece",
    "placement_boxes",
    "tensor_holdings",
]
