"""A whole sliced round on CPU, property-tested: random trainer shardings (uneven cuts,
replicas) of a vLLM-shaped checkpoint, the wants of stub workers (TP 2 / 4, fewer KV heads
than ranks, fused qkv and gate_up, tied head, experts split per matrix or per rank), the
slice plan, each transfer cut from the sending rank's own shard; every worker's
parameters bit-identical to ``load_weights`` of the full tensors, whether the received
slices go through ``load_weights`` or each lands through the landing map (``write_box``)."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.torch_side._sliced_models import SlicedTP, sliced_shapes
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, Wants
from weightwire.torch_side.worker.landing import record_loader_map
from weightwire.torch_side.worker.wants import derive_wants, write_box
from weightwire.trainer.slice_plan import Held, Holdings, build_plan

CONFIGS = [  # (world, heads, kv_heads, expert_parallel, tied)
    (2, 4, 1, False, True),
    (4, 8, 2, False, False),
    (4, 8, 1, True, False),
    (2, 8, 2, True, True),
]


def shapes_of(heads: int, kv: int, tied: bool) -> dict[str, tuple[int, ...]]:
    shapes = sliced_shapes(heads, kv)
    if tied:
        del shapes["lm_head.weight"]
    return shapes


def make(config: tuple, rank: int) -> SlicedTP:
    world, heads, kv, ep, tied = config
    return SlicedTP(rank=rank, world=world, heads=heads, kv_heads=kv, tied=tied, expert_parallel=ep)


@cache
def wants_of(config: tuple) -> tuple[Wants, ...]:
    world, heads, kv, _, tied = config
    metas = [ParamMeta(n, "float32", s) for n, s in shapes_of(heads, kv, tied).items()]
    return tuple(derive_wants(make(config, r), metas) for r in range(world))


@st.composite
def holdings_of(draw: st.DrawFn, shapes: dict[str, tuple[int, ...]]) -> list[Held]:
    """Each tensor cut by uneven split points per dimension, each cell on 1-3 of 6 ranks."""
    held = []
    for name, shape in shapes.items():
        cuts = [
            sorted({0, n, *draw(st.lists(st.integers(1, max(1, n - 1)), max_size=2))})
            for n in shape
        ]
        cells: list[tuple[tuple[int, int], ...]] = [()]
        for c in cuts:
            cells = [(*cell, r) for cell in cells for r in zip(c, c[1:], strict=False)]
        for cell in cells:
            for rank in draw(st.sets(st.integers(0, 5), min_size=1, max_size=3)):
                held.append(Held(name, rank, Box(cell)))
    return held


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(CONFIGS), st.data())
def test_a_sliced_round_loads_what_load_weights_of_the_full_tensors_loads(
    config: tuple, data: st.DataObject
) -> None:
    world, heads, kv, _, tied = config
    shapes = shapes_of(heads, kv, tied)
    metas = [ParamMeta(n, "float32", s) for n, s in shapes.items()]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    full = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    held = data.draw(holdings_of(shapes))
    # each rank's shards: its own copies, the only data a rank may cut transfers from
    shards = {(h.tensor, h.rank, h.box): full[h.tensor][h.box.slices()].copy() for h in held}
    wants = wants_of(config)
    plan = build_plan(metas, Holdings.of(shapes, held), list(wants))
    for w in range(world):
        received = {n: np.full(s, np.nan, np.float32) for n, s in shapes.items()}
        torch.manual_seed(w)
        c = make(config, w)  # lands each received slice through its landing map
        cmap = record_loader_map(c, metas)
        for (rank, worker), transfers in plan.pieces.items():
            if worker != w:
                continue
            for t in transfers:
                key = next(
                    k for k in shards if k[0] == t.tensor and k[1] == rank and k[2].contains(t.box)
                )
                piece = shards[key][t.box.relative_to(key[2]).slices()]
                assert np.isnan(received[t.tensor][t.box.slices()]).all()  # once
                received[t.tensor][t.box.slices()] = piece
                write_box(cmap, t.tensor, t.box, torch.from_numpy(piece))
        torch.manual_seed(w)
        a = make(config, w)
        torch.manual_seed(w)
        b = make(config, w)
        a.load_weights((n, torch.from_numpy(t)) for n, t in received.items())
        b.load_weights((n, torch.from_numpy(t)) for n, t in full.items())
        pb = dict(b.named_parameters())
        pc = dict(c.named_parameters())
        for name, p in a.named_parameters():
            assert torch.equal(p, pb[name]), (config, w, name)
            assert torch.equal(pc[name], pb[name]), ("write_box", config, w, name)
