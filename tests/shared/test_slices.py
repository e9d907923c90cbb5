"""Boxes and wants (``shared.slices``): the arithmetic checked element by element against
numpy masks, and the wants' JSON parse refusing every malformed or inconsistent region."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightwire.shared.slices import Box, SliceError, Wants, first_overlap, union, volume


@st.composite
def shape_and_boxes(draw: st.DrawFn, n: int = 2) -> tuple[tuple[int, ...], list[Box]]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    boxes = []
    for _ in range(n):
        ranges = []
        for dim in shape:
            lo = draw(st.integers(0, dim))
            ranges.append((lo, draw(st.integers(lo, dim))))
        boxes.append(Box(tuple(ranges)))
    return shape, boxes


def mask(shape: tuple[int, ...], boxes: list[Box] | tuple[Box, ...]) -> np.ndarray:
    out = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        out[b.slices()] += 1
    return out


@settings(max_examples=200, deadline=None)
@given(shape_and_boxes())
def test_intersect_and_minus_partition_the_elements(case: tuple) -> None:
    shape, (a, b) = case
    ma, mb = mask(shape, [a]), mask(shape, [b])
    assert a.volume == int(ma.sum())
    common = a.intersect(b)
    assert np.array_equal(mask(shape, [common] if common else []), ma * mb)
    rest = a.minus(b)
    assert len(rest) <= 2 * len(shape) and all(not r.empty for r in rest)
    assert first_overlap(rest) is None
    assert np.array_equal(mask(shape, rest), ma * (1 - mb))
    assert volume(rest) + (common.volume if common else 0) == a.volume
    if common is not None:
        assert a.contains(common) and b.contains(common)
        local = common.relative_to(a)
        assert local.shape == common.shape and local.within(a.shape)


@settings(max_examples=200, deadline=None)
@given(shape_and_boxes(n=4))
def test_union_is_disjoint_and_covers_exactly_the_boxes(case: tuple) -> None:
    shape, boxes = case
    merged = union(boxes)
    assert first_overlap(merged) is None
    assert np.array_equal(mask(shape, merged), np.minimum(mask(shape, boxes), 1))
    assert np.array_equal(mask(shape, union(reversed(boxes))), mask(shape, merged))


@settings(max_examples=100, deadline=None)
@given(shape_and_boxes(n=3), st.text(max_size=20) | st.none())
def test_any_disjoint_wants_survive_json(case: tuple, reason: str | None) -> None:
    shape, boxes = case
    wants = Wants({"t": union(boxes), "s": ()}, reason)
    text = json.dumps(wants.to_json())
    assert Wants.from_json(json.loads(text), {"t": shape, "s": (3,)}) == wants


def test_union_merges_neighbours_into_one_box() -> None:
    rows = [Box.of((r, r + 1), (0, 8)) for r in (3, 0, 2, 1)]
    assert union(rows) == (Box.of((0, 4), (0, 8)),)
    assert union([Box.of((0, 2), (0, 4)), Box.of((0, 2), (4, 8))]) == (Box.of((0, 2), (0, 8)),)


def test_box_contracts() -> None:
    b = Box.of((1, 3), (0, 4))
    assert (b.shape, b.volume, b.origin, b.describe()) == ((2, 4), 8, (1, 0), "[1:3, 0:4]")
    assert Box.whole(()).volume == 1 and Box.whole((0, 3)).empty
    assert b.within((3, 4)) and not b.within((2, 4)) and not b.within((3, 4, 1))
    assert b.intersect(Box.of((3, 5), (0, 4))) is None
    with pytest.raises(SliceError, match=r"boxes \[1:3, 0:4\] and \[0:1\] have different ranks"):
        b.intersect(Box.of((0, 1)))
    with pytest.raises(SliceError, match=r"box \[0:3, 0:4\] is not inside \[1:3, 0:4\]"):
        Box.of((0, 3), (0, 4)).relative_to(b)


SHAPES = {"q": (8, 4), "norm": (4,), "s": ()}


def test_wants_round_trip_through_json() -> None:
    w = Wants({"q": (Box.of((0, 2), (0, 4)), Box.of((6, 8), (0, 4))), "norm": (), "s": (Box.of(),)})
    back = Wants.from_json(json.loads(json.dumps(w.to_json())), SHAPES)
    assert back == w and back.volume("q") == 16 and back.volume("norm") == 0
    whole = Wants.whole(SHAPES, "qkv_proj: the loader computes on it")
    assert Wants.from_json(json.loads(json.dumps(whole.to_json())), SHAPES) == whole
    assert whole.volume("q") == 32 and whole.volume("s") == 1


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"q": [], "norm": []}, r"leave out 1 declared tensor\(s\), first 's'"),
        (
            {"q": [], "norm": [], "s": [], "k": []},
            r"1 tensor\(s\) the session did not declare, first 'k'",
        ),
        (
            {"q": [[[0, 9], [0, 4]]], "norm": [], "s": []},
            r"'q': box \[0:9, 0:4\] is empty or outside",
        ),
        ({"q": [[[2, 2], [0, 4]]], "norm": [], "s": []}, r"'q': box \[2:2, 0:4\] is empty"),
        ({"q": [[[0, 2]]], "norm": [], "s": []}, r"'q': a box is a list of 2 \[lo, hi\] integer"),
        ({"q": [[[0, 2], [0, True]]], "norm": [], "s": []}, r"'q': a box is a list of 2"),
        ({"q": [[[0, 2.0], [0, 4]]], "norm": [], "s": []}, r"'q': a box is a list of 2"),
        ({"q": "whole", "norm": [], "s": []}, r"'q': a list of boxes, got 'whole'"),
        (
            {"q": [[[0, 4], [0, 4]], [[3, 5], [1, 2]]], "norm": [], "s": []},
            r"'q': boxes \[0:4, 0:4\] and \[3:5, 1:2\] overlap",
        ),
    ],
)
def test_wants_parse_refuses_with_the_reason(tensors: dict, message: str) -> None:
    with pytest.raises(SliceError, match=message):
        Wants.from_json({"tensors": tensors, "whole_reason": None}, SHAPES)


def test_wants_parse_refuses_a_bad_envelope() -> None:
    with pytest.raises(SliceError, match="exactly 'tensors' and 'whole_reason'"):
        Wants.from_json({"tensors": {}}, SHAPES)
    with pytest.raises(SliceError, match="whole_reason must be a string or null, got 3"):
        Wants.from_json({"tensors": {}, "whole_reason": 3}, SHAPES)
    with pytest.raises(SliceError, match="'tensors' must be an object"):
        Wants.from_json({"tensors": [], "whole_reason": None}, SHAPES)
