"""What a torch trainer's ranks hold (``torch_side.sender.holdings``): a plain tensor whole
on its rank; a DTensor's boxes per rank from its mesh and placements alone, equal to
torch's own local shape and offset for random shapes and (nested, uneven) shardings, and
to the local shards of real DTensors and FSDP2 parameters over 2 gloo processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from tests.ranks import free_port, two_rank_reports
from weightwire.shared.slices import Box
from weightwire.torch_side.sender.holdings import holdings_of, placement_boxes
from weightwire.trainer.slice_plan import Held, SlicePlanError

SCRIPT = Path(__file__).with_name("_dtensor_holdings_rank.py")


@st.composite
def sharding(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], list[object]]:
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    placements = [
        draw(st.sampled_from([Replicate(), *(Shard(d) for d in range(len(shape))), Shard(-1)]))
        for _ in mesh
    ]
    return shape, mesh, placements


@settings(max_examples=200, deadline=None)
@given(sharding())
def test_boxes_equal_torchs_local_shape_and_offset(case: tuple) -> None:
    shape, mesh_shape, placements = case
    ranks = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)
    boxes = dict(placement_boxes(shape, ranks.tolist(), placements))
    for coord in np.ndindex(*mesh_shape):
        # a DTensor normalises Shard(-1) at construction; torch's helper expects it so
        normal = [Shard(p.dim % len(shape)) if isinstance(p, Shard) else p for p in placements]
        local, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), normal
        )
        box = boxes[int(ranks[coord])]
        if box.empty:
            assert 0 in local
        else:
            assert (box.shape, box.origin) == (tuple(local), tuple(offset)), coord


def test_plain_tensors_are_held_whole_by_their_rank() -> None:
    h = holdings_of({"w": torch.zeros(3, 4), "s": torch.tensor(1.0)}, rank=5)
    assert h.held == {"w": (Held("w", 5, Box.of((0, 3), (0, 4))),), "s": (Held("s", 5, Box.of()),)}


def test_placements_that_are_not_held_slices_are_refused() -> None:
    from torch.distributed.tensor import Partial

    with pytest.raises(SlicePlanError, match=r"w: placement P\(sum\) is not a held slice"):
        placement_boxes((4,), [0, 1], [Partial()], name="w")
    with pytest.raises(SlicePlanError, match="w: 2 placements for a 1-dimensional mesh"):
        placement_boxes((4,), [0, 1], [Shard(0), Shard(0)], name="w")


@pytest.mark.slow
def test_real_dtensors_and_fsdp2_parameters_over_two_gloo_ranks() -> None:
    results = two_rank_reports(SCRIPT, str(free_port()))
    r0, r1 = results
    # every rank computes every rank's boxes of a DTensor alike; a plain tensor is its own
    assert r0["held"].pop("plain") == [[0, [[0, 5]]]] and r1["held"].pop("plain") == [[1, [[0, 5]]]]
    assert r0["held"] == r1["held"]
    assert all(r0["own_ok"].values()) and all(r1["own_ok"].values()), (r0, r1)
    held = r0["held"]
    assert held["rows"] == [[0, [[0, 6], [0, 6]]], [1, [[6, 11], [0, 6]]]]
    assert held["norm"] == [[0, [[0, 6]]], [1, [[0, 6]]]]
    assert held["tiny"] == [[0, [[0, 1], [0, 4]]]]
    assert held["fsdp.1.weight"] == [[0, [[0, 4], [0, 5]]], [1, [[4, 7], [0, 5]]]]
