"""The host side of the fused CUDA delta kernel, on CPU: which tensors go as patches, where
their bytes go in the tight buffers, and the tracker's patch limit (the one rule the kernel
sizes its outputs by and the tracker decides dense vs patch by)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightwire.shared.delta import MAX_PATCH_NUMEL
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.delta import DeltaTracker
from weightwire.trainer.delta_cuda import TILING, Operand, Tiling, layout


def test_layout_places_only_patches_aligned_and_apart() -> None:
    ops = [
        Operand(0, 0, 100, 2, 10, "bfloat16"),  # 3 changed: a patch
        Operand(0, 0, 100, 2, 10, "bfloat16"),  # 0 changed: nothing
        Operand(0, 0, 100, 4, 10, "float32"),  # 11 > limit: dense
        Operand(0, 0, 9, 1, 9, "bool"),  # 9 of 9 within its limit: a patch
        Operand(0, 0, 50, 2, 40, "bfloat16"),  # 33: a patch
    ]
    plan = layout(ops, [3, 0, 11, 9, 33])
    assert plan.index_at == [0, -1, -1, 16, 64]
    assert plan.values_at == [0, -1, -1, 0, 16]
    assert plan.index_bytes == 64 + 144
    assert plan.values_bytes == {"bfloat16": 16 + 80, "bool": 16}


def test_tiles_never_straddle_tensors() -> None:
    per_tile = {size: TILING.threads * TILING.vec * 16 // size for size in (1, 2, 4, 8)}
    assert Operand(0, 0, 0, 2, 0, "x").tiles() == 0
    assert Operand(0, 0, 1, 2, 0, "x").tiles() == 1
    assert Operand(0, 0, per_tile[2], 2, 0, "x").tiles() == 1
    assert Operand(0, 0, per_tile[2] + 1, 2, 0, "x").tiles() == 2
    assert Operand(0, 0, 3 * per_tile[8] - 1, 8, 0, "x").tiles() == 3
    wide = Tiling(threads=512, vec=8)  # 64 KiB of each operand per tile
    assert Operand(0, 0, 32768, 2, 0, "x").tiles(wide) == 1
    assert Operand(0, 0, 32769, 2, 0, "x").tiles(wide) == 2


@pytest.mark.parametrize("bad", [dict(vec=3), dict(vec=32), dict(threads=64), dict(threads=300)])
def test_a_tiling_the_kernel_cannot_compile_is_refused(bad: dict) -> None:
    with pytest.raises(ConfigError, match="need vec in 1, 2, 4, 8, 16 and threads in"):
        Tiling(**{"threads": 256, "vec": 4, **bad})


@settings(max_examples=300, deadline=None)
@given(
    numel=st.integers(0, 10**6) | st.sampled_from([MAX_PATCH_NUMEL, MAX_PATCH_NUMEL + 1]),
    density=st.sampled_from([0.0, 1e-7, 0.01, 0.25, 1 / 3, 0.5, 0.999, 1.0, 1.5]),
    fraction=st.floats(0, 1),
)
def test_limit_is_the_dense_rule(numel: int, density: float, fraction: float) -> None:
    """A tensor goes dense exactly when it changed in at least ``density`` of its elements
    or is past the int32 index range; its patch never has more than ``limit`` elements."""
    tracker = DeltaTracker(None, density=density, anchor_every=0)  # type: ignore[arg-type]
    meta = ParamMeta("w", "bfloat16", (numel,))
    limit = tracker.limit(meta)
    assert 0 <= limit <= numel
    for count in {1, math.floor(fraction * numel), limit, limit + 1, numel}:
        if not 0 < count <= numel:
            continue
        dense = count >= density * numel or numel > MAX_PATCH_NUMEL
        assert (count > limit) == dense, (count, limit)
    assert tracker.limit(meta) == limit  # cached by the same meta


def test_layout_empty_group() -> None:
    plan = layout([], [])
    assert plan.index_bytes == 0 and plan.values_bytes == {} and plan.index_at == []
    assert np.all(np.array(plan.values_at) == 0)


def test_choosing_the_cuda_kernel_without_cupy_is_refused() -> None:
    import pytest

    from weightwire.jax_side.delta import JaxDeltaKernel
    from weightwire.shared.errors import ConfigError
    from weightwire.torch_side.sender.delta import TorchDeltaKernel
    from weightwire.trainer import delta_cuda

    if delta_cuda.available():
        pytest.skip("CuPy sees a GPU here")
    with pytest.raises(ConfigError, match="compaction='cuda' needs CuPy"):
        TorchDeltaKernel("cuda")
    with pytest.raises(ConfigError, match="expand='cuda' needs CuPy"):
        JaxDeltaKernel("cuda")
    with pytest.raises(ConfigError, match="compaction must be one of"):
        TorchDeltaKernel("fast")
    TorchDeltaKernel()  # auto: the fallback
    JaxDeltaKernel()
