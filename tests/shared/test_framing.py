"""Packed framing: golden plans derived by hand, a property test of the boundary rule,
and byte-exact pack/unpack round trips for every wire dtype.

Rule under test (vLLM's packed format): append tensors in order; right after appending
one, if the running total is *strictly greater* than the buffer size, close the chunk.
The crossing tensor belongs to the chunk it closes; tensors are never split.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightwire.shared import (
    WIRE_DTYPES,
    Chunk,
    ParamMeta,
    pack_host,
    plan,
    plan_packed,
    plan_unpacked,
    unpack_host,
)


def metas(*specs: tuple[str, list[int]]) -> list[ParamMeta]:
    return [ParamMeta(f"t{i}", dtype, tuple(shape)) for i, (dtype, shape) in enumerate(specs)]


def as_tuples(chunks: list[Chunk]) -> list[tuple[int, int, int, tuple[int, ...]]]:
    return [(c.start, c.stop, c.nbytes, c.offsets) for c in chunks]


# Each case: (specs, buffer size, expected [(start, stop, nbytes, offsets)]).
# The arithmetic is in the comments; the expectations never call the code under test.
GOLDEN = {
    # No tensors: no broadcast at all.
    "empty": ([], 16, []),
    # float32 scalar: prod([]) = 1 element x 4 bytes = 4; 4 > 16 is false; end of round
    # closes the last chunk.
    "scalar": ([("float32", [])], 16, [(0, 1, 4, (0,))]),
    # float32 [4] = 16 bytes; 16 > 16 is false, so exactly-at-limit does NOT close.
    "exactly_at_limit": ([("float32", [4])], 16, [(0, 1, 16, (0,))]),
    # 16 (not > 16, stays open) then float32 [1] = 4: 20 > 16 closes with both inside.
    "at_limit_then_more": ([("float32", [4]), ("float32", [1])], 16, [(0, 2, 20, (0, 16))]),
    # uint8 [17] = 17 > 16 closes at once; uint8 [1] = 1 starts and ends chunk 2.
    "one_byte_over": ([("uint8", [17]), ("uint8", [1])], 16, [(0, 1, 17, (0,)), (1, 2, 1, (0,))]),
    # uint8 [3] = 3; float32 [100] = 400: 3 + 400 = 403 > 16 closes, the big tensor is
    # not split and the chunk is 403 > buffer; int8 [5] = 5 is the last chunk.
    "larger_than_buffer": (
        [("uint8", [3]), ("float32", [100]), ("int8", [5])],
        16,
        [(0, 2, 403, (0, 3)), (2, 3, 5, (0,))],
    ),
    # bfloat16 [2,3] = 6 x 2 = 12; int64 [1] = 8 -> 20 (not > 20); float16 [3] = 6 -> 26
    # > 20 closes at offsets 0, 12, 20. bool [5] = 5; float8_e4m3fn [4] = 4 -> 9, last.
    "mixed_dtypes": (
        [
            ("bfloat16", [2, 3]),
            ("int64", [1]),
            ("float16", [3]),
            ("bool", [5]),
            ("float8_e4m3fn", [4]),
        ],
        20,
        [(0, 3, 26, (0, 12, 20)), (3, 5, 9, (0, 5))],
    ),
    # Buffer of 1 byte: uint8 [1] -> 1 (not > 1); uint8 [1] -> 2 > 1 closes (0, 1).
    # float32 scalar 4 > 1 closes alone. uint8 [1] -> 1, last chunk.
    "one_byte_buffer": (
        [("uint8", [1]), ("uint8", [1]), ("float32", []), ("uint8", [1])],
        1,
        [(0, 2, 2, (0, 1)), (2, 3, 4, (0,)), (3, 4, 1, (0,))],
    ),
    # Zero-size tensors take no bytes but keep their slot: uint8 [0] -> 0; float32 [1]
    # -> 4 (not > 4); float32 [0,5] -> 4; uint8 [1] -> 5 > 4 closes at offsets
    # 0, 0, 4, 4. The trailing float32 [0] opens a 0-byte last chunk (vLLM's consumer
    # also broadcasts it: it has a tensor, so it is a chunk).
    "zero_size_tensors": (
        [("uint8", [0]), ("float32", [1]), ("float32", [0, 5]), ("uint8", [1]), ("float32", [0])],
        4,
        [(0, 4, 5, (0, 0, 4, 4)), (4, 5, 0, (0,))],
    ),
    # Only zero-size tensors: 0 never exceeds 1, one 0-byte chunk.
    "only_zero_size": ([("uint8", [0]), ("int32", [3, 0])], 1, [(0, 2, 0, (0, 0))]),
    # float32 [2] = 8 > 7 each time: every tensor closes its own chunk.
    "each_tensor_own_chunk": (
        [("float32", [2])] * 3,
        7,
        [(0, 1, 8, (0,)), (1, 2, 8, (0,)), (2, 3, 8, (0,))],
    ),
    # 8 (not > 15) then 16 > 15 closes on the last tensor: no empty trailing chunk.
    "closes_on_last_tensor": ([("float32", [2]), ("float32", [2])], 15, [(0, 2, 16, (0, 8))]),
    # int64 [2,2,2] = 8 x 8 = 64 = limit, stays open; float64 [] = 8 -> 72 > 64 closes.
    "rank3_at_limit_then_scalar": (
        [("int64", [2, 2, 2]), ("float64", [])],
        64,
        [(0, 2, 72, (0, 64))],
    ),
    # float8_e5m2 [3] = 3; int32 [2] = 8 -> 11; bfloat16 [1] = 2 -> 13; all <= 1 GiB.
    "default_buffer_one_chunk": (
        [("float8_e5m2", [3]), ("int32", [2]), ("bfloat16", [1])],
        1 << 30,
        [(0, 3, 13, (0, 3, 11))],
    ),
}


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_golden_packed_plan(case: str) -> None:
    specs, buffer_size, expected = GOLDEN[case]
    assert as_tuples(plan_packed(metas(*specs), buffer_size)) == expected
    assert as_tuples(plan(metas(*specs), packed=True, buffer_size_bytes=buffer_size)) == expected


def test_unpacked_plan_is_one_chunk_per_tensor() -> None:
    # bfloat16 [3] = 6, uint8 [0] = 0, float32 [] = 4: one broadcast each, offset 0.
    ms = metas(("bfloat16", [3]), ("uint8", [0]), ("float32", []))
    expected = [(0, 1, 6, (0,)), (1, 2, 0, (0,)), (2, 3, 4, (0,))]
    assert as_tuples(plan_unpacked(ms)) == expected
    assert as_tuples(plan(ms, packed=False, buffer_size_bytes=1)) == expected


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16", None])
def test_plan_rejects_bad_buffer_size(bad: object) -> None:
    with pytest.raises(ValueError, match="packed_buffer_size_bytes"):
        plan_packed(metas(("uint8", [1])), bad)  # type: ignore[arg-type]


# --- property: the boundary rule holds for any round and any buffer size ----------

_spec = st.tuples(
    st.sampled_from(sorted(WIRE_DTYPES)),
    st.lists(st.integers(min_value=0, max_value=6), max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(specs=st.lists(_spec, max_size=25), buffer_size=st.integers(min_value=1, max_value=300))
def test_plan_obeys_boundary_rule(specs: list[tuple[str, list[int]]], buffer_size: int) -> None:
    ms = metas(*specs)
    sizes = [math.prod(shape) * WIRE_DTYPES[dtype].itemsize for dtype, shape in specs]
    chunks = plan_packed(ms, buffer_size)

    assert sum(c.nbytes for c in chunks) == sum(sizes)
    # Chunks tile the round in order: each tensor in exactly one chunk, never split.
    assert [c.start for c in chunks] == [0, *(c.stop for c in chunks)][: len(chunks)]
    assert (chunks[-1].stop if chunks else 0) == len(ms)
    for k, c in enumerate(chunks):
        own = sizes[c.start : c.stop]
        assert len(c) >= 1
        assert c.nbytes == sum(own)
        assert list(c.offsets) == [sum(own[:j]) for j in range(len(own))]
        # No earlier tensor already pushed the total over the limit ...
        assert c.nbytes - own[-1] <= buffer_size
        # ... and every chunk but the last was closed by crossing it (strictly).
        if k < len(chunks) - 1:
            assert c.nbytes > buffer_size


# --- pack_host / unpack_host ----------------------------------------------------


def _random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    # Random raw bytes viewed as the dtype: covers NaN payloads, subnormals, every bool
    # byte value; compared as bytes, so NaN != NaN cannot hide a mismatch.
    row = WIRE_DTYPES[dtype]
    raw = rng.integers(0, 256, size=math.prod(shape) * row.itemsize, dtype=np.uint8)
    if dtype == "bool":
        raw = raw & 1
    return raw.view(row.numpy).reshape(shape)


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("buffer_size", [1, 7, 64, 1 << 20])
def test_pack_unpack_round_trip_every_dtype(dtype: str, buffer_size: int) -> None:
    rng = np.random.default_rng(sum(map(ord, dtype)) + buffer_size)
    shapes = [(3, 5), (), (0, 4), (17,), (2, 3, 4)]
    ms = [ParamMeta(f"p{i}", dtype, s) for i, s in enumerate(shapes)]
    arrays = [_random_array(rng, dtype, s) for s in shapes]
    received = {}
    stream = b""
    for chunk in plan_packed(ms, buffer_size):
        buf = pack_host(arrays[chunk.start : chunk.stop], chunk)
        assert buf.dtype == np.uint8 and buf.nbytes == chunk.nbytes
        expected_bytes = b"".join(a.tobytes() for a in arrays[chunk.start : chunk.stop])
        assert buf.tobytes() == expected_bytes
        stream += buf.tobytes()
        received.update(unpack_host(buf.copy(), ms, chunk))
    assert stream == b"".join(a.tobytes() for a in arrays)
    assert list(received) == [m.name for m in ms]
    for meta, arr in zip(ms, arrays, strict=True):
        got = received[meta.name]
        assert got.dtype == WIRE_DTYPES[dtype].numpy
        assert got.shape == meta.shape
        assert got.tobytes() == arr.tobytes()


def test_pack_into_given_buffer_and_views() -> None:
    ms = metas(("float32", [2]), ("int8", [3]))
    arrays = [np.array([1.5, -2.0], np.float32), np.array([1, -2, 3], np.int8)]
    (chunk,) = plan_packed(ms, 100)
    out = np.zeros(64, np.uint8)
    packed = pack_host(arrays, chunk, out)
    assert packed.nbytes == 11 and np.shares_memory(packed, out)
    views = dict(unpack_host(out, ms, chunk, copy=False))
    assert np.shares_memory(views["t0"], out)
    np.testing.assert_array_equal(views["t0"], arrays[0])
    np.testing.assert_array_equal(views["t1"], arrays[1])


def test_pack_is_little_endian_and_c_order() -> None:
    # float32 1.0 = 0x3F800000 -> little-endian bytes 00 00 80 3F; a big-endian and a
    # Fortran-order source must produce the same wire bytes.
    ms = metas(("float32", [1]), ("int32", [2, 2]))
    big = np.array([1.0], dtype=">f4")
    fortran = np.asfortranarray(np.array([[1, 2], [3, 4]], np.int32))
    (chunk,) = plan_packed(ms, 1 << 10)
    wire = pack_host([big, fortran], chunk).tobytes()
    assert wire[:4] == bytes([0x00, 0x00, 0x80, 0x3F])
    assert wire[4:] == np.array([1, 2, 3, 4], "<i4").tobytes()


def test_pack_rejects_wrong_sizes_and_counts() -> None:
    ms = metas(("float32", [2]), ("uint8", [1]))
    (chunk,) = plan_packed(ms, 1 << 10)
    with pytest.raises(ValueError, match="tensor 0 of the round has 4 bytes, its slot has 8"):
        pack_host([np.zeros(1, np.float32), np.zeros(1, np.uint8)], chunk)
    with pytest.raises(ValueError, match="chunk holds 2 tensors, got 1"):
        pack_host([np.zeros(2, np.float32)], chunk)
    with pytest.raises(ValueError, match="pack buffer"):
        pack_host([np.zeros(2, np.float32), np.zeros(1, np.uint8)], chunk, np.zeros(8, np.uint8))


def test_unpack_rejects_short_buffer() -> None:
    ms = metas(("float32", [2]))
    (chunk,) = plan_packed(ms, 1 << 10)
    with pytest.raises(ValueError, match="holds 7 bytes, chunk needs 8"):
        list(unpack_host(np.zeros(7, np.uint8), ms, chunk))


def test_bfloat16_wire_bytes_match_ml_dtypes() -> None:
    # bfloat16 is the top half of float32: 1.0 = 0x3F80 -> bytes 80 3F.
    ms = metas(("bfloat16", [1]))
    (chunk,) = plan_packed(ms, 2)
    wire = pack_host([np.array([1.0], ml_dtypes.bfloat16)], chunk).tobytes()
    assert wire == bytes([0x80, 0x3F])
