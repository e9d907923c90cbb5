"""The batched strided / casting copy of ``weightwire_ipc`` write-through on a GPU: for the
landings of ``tests/backends/test_ipc_strided_batch.py`` (fused qkv and gate_up rows, a TP
rank's column slice, a transposed tensor, casts between every float pair, raw words of
int8, bool and float8, a landing of several tiles, an empty one), one launch per dtype pair
writes the same bytes as one launch per landing and as numpy's copy of each landing; over
several rounds (the table reused from the device), and a table of more tiles than blocks.

    CUDA_VISIBLE_DEVICES=0 pytest -m gpu tests/gpu/test_ipc_strided_batch_gpu.py
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from tests.backends.test_ipc_strided_batch import (
    PAIRS,
    PARAM_AT,
    _case,
    _expected,
    _sources,
    _two_pairs,
)
from weightwire.backends.ipc.through import table as through_table
from weightwire.backends.ipc.through.table import (
    Alloc,
    Land,
    LandingTable,
    ParamSlot,
    TensorLands,
    plan_copies,
)
from weightwire.shared.meta import ParamMeta


def _write(
    monkeypatch: pytest.MonkeyPatch,
    metas: list[ParamMeta],
    table: LandingTable,
    memory: np.ndarray,
    offsets: list[int],
    batch: str,
    rounds: int = 3,
    param_at: int = PARAM_AT,
) -> tuple[np.ndarray, Any]:
    """The parameters' bytes after ``rounds`` chunks of every landing, on the GPU."""
    import cupy as cp

    from weightwire.backends.device import StreamRef
    from weightwire.backends.ipc.through.kernels import StridedCopy

    monkeypatch.setenv("WEIGHTWIRE_IPC_STRIDED_BATCH", batch)
    device = cp.asarray(memory)
    base = device.data.ptr
    stream = cp.cuda.Stream(non_blocking=True)
    copier = StridedCopy(cp, 0, stream.ptr)
    prepared = [
        [(copier.prepare(j), base + param_at) for j in c.strided] for c in plan_copies(table, metas)
    ]
    ref = StreamRef(stream.ptr)
    for _ in range(rounds):
        with stream:  # on the copies' stream: a non-blocking one does not wait for the legacy
            device[param_at:] = 0
        jobs = [
            (launch, base + at, alloc)
            for at, p in zip(offsets, prepared, strict=True)
            for launch, alloc in p
        ]
        copier.launch_all(jobs, ref, deadline=time.monotonic() + 60, alive=lambda: None)
        stream.synchronize()
    got = cp.asnumpy(device)
    copier.close()
    return got, copier


def _compare(got: np.ndarray, want: np.ndarray, param_at: int = PARAM_AT) -> None:
    diff = np.flatnonzero(got != want)
    assert not diff.size, f"{diff.size} bytes differ, the first at {int(diff[0]) - param_at}"


@pytest.mark.gpu
@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_one_launch_per_chunk_writes_what_one_launch_per_landing_writes(
    monkeypatch: pytest.MonkeyPatch, src: str, dst: str
) -> None:
    monkeypatch.setattr(through_table, "_runs", lambda *a: None)  # every landing a kernel copy
    metas, table = _case(src, dst)
    memory, offsets = _sources(metas, np.random.default_rng(11))
    batched, _ = _write(monkeypatch, metas, table, memory, offsets, "1")
    alone, _ = _write(monkeypatch, metas, table, memory, offsets, "0")
    _compare(batched, alone)
    _compare(batched, _expected(memory, offsets, metas, table))


@pytest.mark.gpu
def test_two_dtype_pairs_in_one_chunk_are_two_launches_with_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metas, table = _two_pairs()
    memory, offsets = _sources(metas, np.random.default_rng(5))
    batched, copier = _write(monkeypatch, metas, table, memory, offsets, "1")
    assert [k for k, v in copier._batch_kernels.items() if v is not None] == [
        ("float32", "bfloat16")  # the lone bfloat16 -> float32 landing went alone
    ]
    alone, _ = _write(monkeypatch, metas, table, memory, offsets, "0")
    _compare(batched, alone)
    _compare(batched, _expected(memory, offsets, metas, table))


@pytest.mark.gpu
def test_a_table_of_more_tiles_than_blocks_is_copied_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightwire.backends.ipc.through.kernels import TILE

    # a float32 [rows, 2 * cols] tensor, this rank's right half into a bfloat16 parameter,
    # and a small one beside it: > 4096 tiles
    rows, cols = 4100, TILE
    metas = [ParamMeta("big", "float32", (rows, 2 * cols)), ParamMeta("small", "float32", (3,))]
    params = (
        ParamSlot("big", 0, 0, rows * cols * 2, "bfloat16"),
        ParamSlot("small", 0, rows * cols * 2, 6, "bfloat16"),
    )
    lands = (
        TensorLands("big", (Land(0, (rows, cols), cols, (2 * cols, 1), 0, (cols, 1)),)),
        TensorLands("small", (Land(1, (3,), 0, (1,), 0, (1,)),)),
    )
    table = LandingTable((Alloc(bytes(64), rows * cols * 2 + 64),), params, lands)
    param_at = rows * cols * 8 + 4096
    arena = param_at + rows * cols * 2 + 64
    memory, offsets = _sources(metas, np.random.default_rng(2), arena, param_at)
    batched, _ = _write(monkeypatch, metas, table, memory, offsets, "1", 1, param_at)
    _compare(batched, _expected(memory, offsets, metas, table, param_at), param_at)
