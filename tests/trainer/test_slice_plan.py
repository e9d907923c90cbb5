"""The slice plan (``trainer.slice_plan``) over random shardings: every element a worker
wants arrives exactly once, from a rank holding it; replicas share the bytes; the plan is
deterministic; what no rank holds is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, Wants, union
from weightwire.trainer.slice_plan import Held, Holdings, PlanCache, SlicePlanError, build_plan

RANKS = 6


@st.composite
def grid_boxes(draw: st.DrawFn, shape: tuple[int, ...]) -> list[Box]:
    """``shape`` cut by uneven split points per dimension (some cells may be empty)."""
    cuts = []
    for n in shape:
        inner = draw(st.lists(st.integers(0, n), max_size=3))
        cuts.append(sorted({0, n, *inner}))
    cells = [()]
    for c in cuts:
        cells = [(*cell, (lo, hi)) for cell in cells for lo, hi in zip(c, c[1:], strict=False)]
    return [Box(cell) for cell in cells]


@st.composite
def session(draw: st.DrawFn) -> tuple[list[ParamMeta], Holdings, list[Wants]]:
    metas, held = [], []
    for t in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(["bfloat16", "float32", "int8"]))
        metas.append(ParamMeta(f"t{t}", dtype, shape))
        for box in draw(grid_boxes(shape)):
            ranks = draw(st.sets(st.integers(0, RANKS - 1), min_size=1, max_size=3))
            held += [Held(f"t{t}", r, box) for r in ranks]
        if draw(st.booleans()):  # an extra, overlapping copy somewhere (a stale replica)
            held.append(Held(f"t{t}", draw(st.integers(0, RANKS - 1)), draw(grid_boxes(shape))[0]))
    wants = []
    for _ in range(draw(st.integers(1, 4))):
        regions = {}
        for m in metas:
            boxes = draw(st.lists(st.sampled_from(draw(grid_boxes(m.shape))), max_size=3))
            regions[m.name] = union(boxes)
        wants.append(Wants(regions))
    holdings = Holdings.of({m.name: m.shape for m in metas}, held)
    return metas, holdings, wants


def mask(shape: tuple[int, ...], boxes: tuple[Box, ...] | list[Box]) -> np.ndarray:
    out = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        out[b.slices()] += 1
    return out


@settings(max_examples=150, deadline=None)
@given(session())
def test_every_wanted_element_once_from_a_rank_holding_it(case: tuple) -> None:
    metas, holdings, wants = case
    plan = build_plan(metas, holdings, wants)
    assert build_plan(metas, holdings, wants) == plan  # deterministic
    got = {(w, m.name): np.zeros(m.shape, dtype=np.int64) for w in range(len(wants)) for m in metas}
    sizes = {
        m.name: np.dtype(m.dtype if m.dtype != "bfloat16" else "float16").itemsize for m in metas
    }
    for (rank, w), transfers in plan.pieces.items():
        assert transfers, "no empty transfer lists"
        for t in transfers:
            assert not t.box.empty and t.nbytes == t.box.volume * sizes[t.tensor]
            assert any(h.rank == rank and h.box.contains(t.box) for h in holdings.held[t.tensor])
            got[(w, t.tensor)][t.box.slices()] += 1
    for w, want in enumerate(wants):
        for m in metas:
            assert np.array_equal(got[(w, m.name)], mask(m.shape, want.regions[m.name]))
        assert plan.worker_bytes[w] == sum(want.volume(m.name) * sizes[m.name] for m in metas)
    assert sum(plan.rank_bytes.values()) == sum(plan.worker_bytes.values())
    order = [m.name for m in metas]
    for transfers in plan.pieces.values():
        keys = [(order.index(t.tensor), t.box.ranges) for t in transfers]
        assert keys == sorted(keys)


def test_replicas_share_the_bytes() -> None:
    """A tensor replicated on 4 ranks, 8 workers each wanting a quarter: 2 quarters a rank."""
    metas = [ParamMeta("w", "float32", (8, 4))]
    holdings = Holdings.of({"w": (8, 4)}, [Held("w", r, Box.whole((8, 4))) for r in range(4)])
    wants = [Wants({"w": (Box.of((2 * (w % 4), 2 * (w % 4) + 2), (0, 4)),)}) for w in range(8)]
    plan = build_plan(metas, holdings, wants)
    assert plan.rank_bytes == {0: 64, 1: 64, 2: 64, 3: 64}
    assert plan.worker_bytes == dict.fromkeys(range(8), 32)


def test_a_wanted_slice_cut_across_shards_comes_from_each_holder() -> None:
    metas = [ParamMeta("w", "bfloat16", (6, 2))]
    held = [Held("w", 0, Box.of((0, 4), (0, 2))), Held("w", 1, Box.of((4, 6), (0, 2)))]
    plan = build_plan(
        metas, Holdings.of({"w": (6, 2)}, held), [Wants({"w": (Box.of((3, 6), (0, 2)),)})]
    )
    assert {k: [t.box for t in v] for k, v in plan.pieces.items()} == {
        (0, 0): [Box.of((3, 4), (0, 2))],
        (1, 0): [Box.of((4, 6), (0, 2))],
    }
    assert plan.of_rank(1) == {0: plan.pieces[(1, 0)]}


def test_refusals_name_the_problem() -> None:
    metas = [ParamMeta("w", "float32", (4, 4))]
    partial = Holdings.of({"w": (4, 4)}, [Held("w", 0, Box.of((0, 3), (0, 4)))])
    with pytest.raises(
        SlicePlanError, match=r"worker 0 wants 'w' \[3:4, 0:4\], which no trainer rank holds"
    ):
        build_plan(metas, partial, [Wants({"w": (Box.whole((4, 4)),)})])
    with pytest.raises(
        SlicePlanError, match=r"worker 0 wants 'w' \[0:5, 0:4\], outside its shape \[4, 4\]"
    ):
        build_plan(metas, partial, [Wants({"w": (Box.of((0, 5), (0, 4)),)})])
    with pytest.raises(SlicePlanError, match=r"worker 0 wants 'w' \[0:4\], outside its shape"):
        build_plan(metas, partial, [Wants({"w": (Box.of((0, 4)),)})])
    with pytest.raises(SlicePlanError, match=r"worker 0's wants do not name 'w'"):
        build_plan(metas, partial, [Wants({})])
    other = Holdings.of({"w": (4, 5)}, [])
    with pytest.raises(
        SlicePlanError, match=r"holdings describe 'w' as \[4, 5\], the session declares \[4, 4\]"
    ):
        build_plan(metas, other, [])
    with pytest.raises(
        SlicePlanError, match=r"rank 2 holds 'w' box \[0:5, 0:4\], outside its shape"
    ):
        Holdings.of({"w": (4, 4)}, [Held("w", 2, Box.of((0, 5), (0, 4)))])
    with pytest.raises(SlicePlanError, match=r"a rank holds 'v', which has no declared shape"):
        Holdings.of({"w": (4, 4)}, [Held("v", 0, Box.of((0, 1), (0, 4)))])


def test_the_plan_is_built_once_and_rebuilt_when_the_metadata_changes() -> None:
    metas = [ParamMeta("w", "float32", (4, 4))]
    holdings = Holdings.of({"w": (4, 4)}, [Held("w", 0, Box.whole((4, 4)))])
    wants = [Wants({"w": (Box.of((0, 2), (0, 4)),)})]
    cache = PlanCache()
    first = cache.plan(metas, holdings, wants)
    again = cache.plan(list(metas), Holdings.of({"w": (4, 4)}, holdings.held["w"]), list(wants))
    assert again is first and cache.builds == 1
    bf16 = [ParamMeta("w", "bfloat16", (4, 4))]
    other = cache.plan(bf16, holdings, wants)
    assert other is not first and cache.builds == 2 and other.worker_bytes == {0: 16}
