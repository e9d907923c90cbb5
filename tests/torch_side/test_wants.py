"""A worker's wants (``torch_side.worker.wants``) from its landing map: loading a checkpoint
in which only the wanted boxes hold the real values gives parameters bit-identical to
``load_weights`` of the full tensors, at TP 2 and 4, with fewer KV heads than ranks, fused
qkv / gate_up, MoE (experts split per matrix or whole experts per rank) and a tied head;
the wants are boxes (never index lists), just what the rank reads."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.torch_side._landing_models import Refusing
from tests.torch_side._sliced_models import HEAD_DIM, HIDDEN, SlicedTP, sliced_shapes
from tests.torch_side.test_landing import core_for
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, SliceError, Wants, union
from weightwire.torch_side.worker.landing import Landing, record_loader_map
from weightwire.torch_side.worker.wants import (
    derive_wants,
    landing_box,
    session_wants,
    wants_from_map,
    write_box,
)


def metas_of(shapes: dict[str, tuple[int, ...]]) -> list[ParamMeta]:
    return [ParamMeta(n, "bfloat16", s) for n, s in shapes.items()]


def checkpoint(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def only_wanted(ck: dict[str, torch.Tensor], wants: Wants) -> dict[str, torch.Tensor]:
    """The checkpoint with every element outside the wanted boxes replaced by other
    values: a loader reading one of those would land them."""
    out = {}
    for name, t in ck.items():
        masked = -t - 3
        for box in wants.regions[name]:
            masked[box.slices()] = t[box.slices()]
        out[name] = masked
    return out


def twins(make: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(1)
    a = make()
    torch.manual_seed(1)
    return a, make()


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert torch.equal(p, pb[name]), name


LAYOUTS = [
    # (world, heads, kv_heads, expert_parallel)
    (2, 8, 2, False),  # kv heads == ranks: k/v split
    (2, 4, 1, True),  # one kv head, replicated on both ranks; whole experts per rank
    (4, 8, 2, False),  # GQA: 2 kv heads over 4 ranks, each on 2 ranks
    (4, 8, 1, True),
]


@pytest.mark.parametrize(("world", "heads", "kv", "ep"), LAYOUTS)
@pytest.mark.parametrize("tied", [False, True])
def test_loading_only_the_wanted_boxes_equals_load_weights(
    world: int, heads: int, kv: int, ep: bool, tied: bool
) -> None:
    shapes = sliced_shapes(heads, kv)
    if tied:
        del shapes["lm_head.weight"]
    metas = metas_of(shapes)
    ck = checkpoint(shapes, world * 10 + kv)
    every: dict[str, list[Box]] = {n: [] for n in shapes}
    for rank in range(world):

        def make(rank: int = rank) -> SlicedTP:
            return SlicedTP(
                rank=rank, world=world, heads=heads, kv_heads=kv, tied=tied, expert_parallel=ep
            )

        a, b = twins(make)
        wants = derive_wants(make(), metas)
        assert wants.whole_reason is None
        assert Wants.from_json(json.loads(json.dumps(wants.to_json())), shapes) == wants
        a.load_weights(only_wanted(ck, wants).items())
        b.load_weights(ck.items())
        assert_same_params(a, b)
        for name, boxes in wants.regions.items():
            assert len(boxes) <= 2, (name, boxes)  # boxes, never a list per row
            every[name] += boxes
    # together the ranks want every element of every tensor (each is served somewhere)
    for name, boxes in every.items():
        assert union(boxes) == (Box.whole(shapes[name]),), name


def test_wants_are_the_slices_the_rank_reads() -> None:
    """TP 4, 2 KV heads: rank 3 wants q rows 12:16, k/v rows of KV head 1 (2:4), a
    quarter of each MLP / expert matrix, its padded vocab rows (9:11), norm and router
    whole."""
    shapes = sliced_shapes(8, 2)
    wants = derive_wants(SlicedTP(rank=3, world=4), metas_of(shapes))
    r = wants.regions
    attn = "model.layers.0.self_attn."
    assert r[attn + "q_proj.weight"] == (Box.of((12, 16), (0, HIDDEN)),)
    assert r[attn + "k_proj.weight"] == (Box.of((2, 4), (0, HIDDEN)),)
    assert r[attn + "v_proj.bias"] == (Box.of((2, 4)),)
    assert r[attn + "o_proj.weight"] == (Box.of((0, HIDDEN), (12, 16)),)
    assert r["model.layers.0.mlp.up_proj.weight"] == (Box.of((6, 8), (0, HIDDEN)),)
    assert r["model.layers.1.mlp.experts.2.down_proj.weight"] == (Box.of((0, HIDDEN), (6, 8)),)
    assert r["model.embed_tokens.weight"] == (Box.of((9, 11), (0, HIDDEN)),)
    assert r["model.norm.weight"] == (Box.whole((HIDDEN,)),)
    assert r["model.layers.1.mlp.gate.weight"] == (
        Box.whole(shapes["model.layers.1.mlp.gate.weight"]),
    )
    total = sum(wants.volume(n) for n in shapes)
    assert total < sum(int(np.prod(s)) for s in shapes.values()) // 3
    ep = derive_wants(SlicedTP(rank=1, world=2, expert_parallel=True), metas_of(shapes))
    assert ep.regions["model.layers.1.mlp.experts.0.up_proj.weight"] == ()  # rank 0's expert
    assert ep.regions["model.layers.1.mlp.experts.3.up_proj.weight"] == (
        Box.whole(shapes["model.layers.1.mlp.experts.3.up_proj.weight"]),
    )
    assert HEAD_DIM == 2


def test_a_refused_map_wants_every_tensor_whole_and_says_why_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metas = [ParamMeta("w.weight", "bfloat16", (4, 4))]
    with caplog.at_level(logging.WARNING, logger="weightwire.torch_side.worker.wants"):
        wants = derive_wants(Refusing("computes"), metas)
    assert wants == Wants(
        {"w.weight": (Box.whole((4, 4)),)},
        "w.weight: the loader computes on it (aten.mul.Tensor), not a plain copy",
    )
    (record,) = caplog.records
    assert record.getMessage() == (
        "no landing map, this worker wants every tensor whole: w.weight: the loader computes "
        "on it (aten.mul.Tensor), not a plain copy"
    )


class Strided(torch.nn.Module):
    """Loads every other row of an 8x4 checkpoint tensor (a view that is not a box)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Module()
        self.w.weight = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def load_weights(self, weights: object) -> None:
        for _, t in weights:  # type: ignore[attr-defined]
            self.w.weight.data.copy_(t[::2])


def test_a_view_that_is_not_a_box_wants_the_whole_tensor() -> None:
    metas = [ParamMeta("w.weight", "float32", (8, 4))]
    lmap = record_loader_map(Strided(), metas)
    (ld,) = lmap.tensors["w.weight"].landings
    assert landing_box((8, 4), ld) is None
    assert wants_from_map(lmap, metas).regions == {"w.weight": (Box.whole((8, 4)),)}


def test_write_box_refuses_a_non_box_landing_and_a_wrong_piece() -> None:
    metas = [ParamMeta("w.weight", "float32", (8, 4))]
    lmap = record_loader_map(Strided(), metas)
    with pytest.raises(SliceError, match=r"w\.weight: its loader reads a view that is not a box"):
        write_box(lmap, "w.weight", Box.of((0, 2), (0, 4)), torch.zeros(2, 4))
    with pytest.raises(SliceError, match=r"a \[2, 3\] piece for box \[0:2, 0:4\] of a \[8, 4\]"):
        write_box(lmap, "w.weight", Box.of((0, 2), (0, 4)), torch.zeros(2, 3))
    with pytest.raises(SliceError, match=r"a \[9, 4\] piece for box \[0:9, 0:4\]"):
        write_box(lmap, "w.weight", Box.of((0, 9), (0, 4)), torch.zeros(9, 4))


@pytest.mark.parametrize(
    ("landing", "box"),
    [
        (Landing("p", (2, 4), 8, (4, 1), 0, (4, 1)), Box.of((2, 4), (0, 4))),  # narrow rows
        (Landing("p", (4, 2), 2, (4, 1), 0, (2, 1)), Box.of((0, 4), (2, 4))),  # narrow cols
        (Landing("p", (3, 4), 1, (1, 4), 0, (4, 1)), Box.of((0, 4), (1, 4))),  # transposed
        (Landing("p", (4,), 4, (1,), 0, (1,)), Box.of((1, 2), (0, 4))),  # select a row
        (Landing("p", (1, 4), 4, (0, 1), 0, (4, 1)), Box.of((1, 2), (0, 4))),  # unsqueezed
        (Landing("p", (8,), 4, (1,), 0, (1,)), None),  # flattened across rows
        (Landing("p", (3, 4), 8, (4, 1), 0, (4, 1)), None),  # past the last row
    ],
)
def test_landing_box_of_each_view(landing: Landing, box: Box | None) -> None:
    assert landing_box((4, 4), landing) == box


def test_session_wants_use_the_cached_map_and_its_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shapes = sliced_shapes(8, 2)
    model = SlicedTP(rank=2, world=4)
    core = core_for(model)
    wants = session_wants(core.caches, metas_of(shapes))
    assert wants == derive_wants(model, metas_of(shapes))
    assert core.caches.loader_map(metas_of(shapes)) is not None  # recorded once, kept
    refusing = core_for(Refusing("computes"))
    metas = [ParamMeta("w.weight", "bfloat16", (4, 4))]
    with caplog.at_level(logging.WARNING, logger="weightwire.torch_side.worker.target_caches"):
        first = session_wants(refusing.caches, metas)
        assert session_wants(refusing.caches, metas) == first
    assert first == Wants(
        {"w.weight": (Box.whole((4, 4)),)},
        "w.weight: the loader computes on it (aten.mul.Tensor), not a plain copy",
    )
    assert len(caplog.records) == 1  # said once
