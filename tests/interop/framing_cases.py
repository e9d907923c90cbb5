"""The awkward tensor sets the framing interop tests send both ways (vLLM's packed producer
and consumer against weightwire's senders and receiver).

Each set is built to hit one edge of the packed layout: every wire dtype in one layer,
scalars, zero-size views, offsets that need reordering to stay aligned (and one no
reordering can fix), chunks that fill a buffer exactly, overflow it, or hold one tensor each.
Values are random bytes (floats: normal values, no NaN payloads that torch and numpy may
canonicalize), so a byte-for-byte comparison is meaningful.
"""

from __future__ import annotations

import numpy as np
import torch

from weightwire.shared.dtypes import WIRE_DTYPES


def _arr(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    row = WIRE_DTYPES[dtype]
    raw = rng.integers(0, 256, int(np.prod(shape, dtype=np.int64)) * row.itemsize, dtype=np.uint8)
    if dtype == "bool":
        raw = raw & 1
    if dtype.startswith(
        ("float", "bfloat")
    ):  # no NaN payloads: torch and numpy may canonicalize them
        vals = rng.standard_normal(int(np.prod(shape, dtype=np.int64))).astype(row.numpy)
        return vals.reshape(shape)
    return raw.view(row.numpy).reshape(shape)


def framing_case(name: str, seed: int = 0) -> tuple[dict[str, np.ndarray], int]:
    """``(tensors in source order, packed_buffer_size_bytes)``."""
    rng = np.random.default_rng(seed)
    L = "model.layers"
    specs: list[tuple[str, str, tuple[int, ...]]]
    size = 1 << 16
    if name == "mixed-dtypes":  # every wire dtype in one layer: reordered so each offset is aligned
        specs = [(f"{L}.0.t_{d}", d, (3,)) for d in sorted(WIRE_DTYPES)] + [
            (f"{L}.0.pad", "int8", (1,))
        ]
    elif name == "mixed-dtypes-aligned":  # already aligned: sent in source order
        specs = [
            (f"{L}.0.t_{d}", d, (8,))
            for d in (
                "float64",
                "int64",
                "float32",
                "int32",
                "bfloat16",
                "float16",
                "int8",
                "uint8",
                "bool",
                "float8_e4m3fn",
                "float8_e5m2",
            )
        ]
    elif name == "scalars":
        specs = [
            (f"{L}.0.scale", "float32", ()),
            (f"{L}.0.w", "bfloat16", (4, 2)),
            (f"{L}.0.step", "int64", ()),
            ("model.norm.bias", "float16", ()),
        ]
    elif name == "zero-size":  # empty views need aligned offsets too: reordered inside layer 0
        specs = [
            (f"{L}.0.a", "int8", (3,)),
            (f"{L}.0.empty", "float32", (0,)),
            (f"{L}.0.e2", "bfloat16", (2, 0)),
            (f"{L}.0.b", "float32", (5,)),
            (f"{L}.0.pad", "int8", (1,)),
            (f"{L}.1.only_empty", "int64", (0, 4)),
        ]
    elif name == "unaligned-in-layer":
        specs = [
            (f"{L}.0.mask", "bool", (1,)),
            (f"{L}.0.w", "bfloat16", (3,)),
            (f"{L}.0.q", "float8_e4m3fn", (5,)),
            (f"{L}.0.idx", "int64", (2,)),
            (f"{L}.0.pad", "int8", (7,)),
        ]
    elif (
        name == "unaligned-across-layers"
    ):  # layer 0 ends at byte 3: nothing inside layer 1 can fix it
        specs = [(f"{L}.0.q", "int8", (3,)), (f"{L}.1.w", "float32", (2,))]
    elif (
        name == "buffer-edges"
    ):  # exactly full (no close), one over (closes), bigger than the buffer, 1-byte tail
        size = 64
        specs = [
            (f"{L}.0.full", "float32", (16,)),
            (f"{L}.0.tail", "int8", (1,)),
            (f"{L}.1.over", "float32", (17,)),
            (f"{L}.2.huge", "bfloat16", (100,)),
            (f"{L}.3.one", "uint8", (1,)),
            (f"{L}.3.w", "float32", (15,)),
        ]
    elif name == "tiny-buffer":  # every tensor closes its own chunk
        size = 1
        specs = [
            (f"{L}.0.a", "int8", (3,)),
            (f"{L}.1.b", "float32", (2,)),
            (f"{L}.2.c", "float64", ()),
            (f"{L}.3.d", "bool", (0,)),
        ]
    else:
        raise KeyError(name)
    return {n: _arr(rng, d, s) for n, d, s in specs}, size


SENDABLE = [
    "mixed-dtypes",
    "mixed-dtypes-aligned",
    "scalars",
    "zero-size",
    "unaligned-in-layer",
    "buffer-edges",
    "tiny-buffer",
]
REFUSED = {"unaligned-across-layers": ("model.layers.1.w", "not a multiple of its 4-byte itemsize")}


def assert_same_bytes(got: dict[str, torch.Tensor], want: dict[str, np.ndarray]) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for name, arr in want.items():
        t = got[name]
        assert tuple(t.shape) == arr.shape, name
        assert str(t.dtype).split(".")[-1] == WIRE_DTYPES_BY_NUMPY[arr.dtype], name
        assert t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == arr.tobytes(), name


WIRE_DTYPES_BY_NUMPY = {row.numpy: name for name, row in WIRE_DTYPES.items()}
