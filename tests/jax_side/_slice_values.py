"""Deterministic values of a test checkpoint, computable for any box alone (numpy only): a
trainer process builds its shards from them without ever holding a whole tensor, and the
test checks what the workers received against them."""

from __future__ import annotations

import numpy as np

from weightwire.shared.slices import Box


def slice_values(seed: int, shape: tuple[int, ...], box: Box) -> np.ndarray:
    """Element ``i`` (flat, row-major in ``shape``) of tensor ``seed`` is a small integer
    (exact in float32) that differs between neighbours and tensors."""
    grid = np.indices(box.shape, dtype=np.int64)
    flat = np.zeros(box.shape, dtype=np.int64)
    for d, (lo, _) in enumerate(box.ranges):
        flat = flat * shape[d] + grid[d] + lo
    return ((flat * 7919 + seed * 104729) % 1021 - 510).astype(np.float32)
