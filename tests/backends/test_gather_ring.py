"""The pull path's one-time set-up (kernel compile + module load, tables) happens at the
join, so a first round beside a training step makes none of those context-wide calls."""

import time

import numpy as np
import pytest

from tests.backends.test_ipc_gather import MIN_BATCH, FakeCupy, GatherCopy, _copy, _tensors
from weightwire.backends.ipc.gather import TILE_BYTES


def test_a_warmed_copier_compiles_and_allocates_nothing_in_a_round() -> None:
    cp = FakeCupy()
    gc = GatherCopy(cp, 0, 7)
    gc.warm(64 * TILE_BYTES)
    setup: list[str] = []
    cp.RawKernel = lambda *a: setup.append("compile")  # type: ignore[method-assign]
    cp.cuda.alloc_pinned_memory = lambda n: setup.append("pinned") or bytearray(n)
    empty = cp.empty
    cp.empty = lambda *a, **k: setup.append("empty") or empty(*a, **k)  # type: ignore[method-assign]
    _copy(cp, [1000] * MIN_BATCH, gc)
    assert setup == [] and ("launch", MIN_BATCH) in cp.log


def test_an_unwarmed_copier_does_its_set_up_in_the_round() -> None:
    cp = FakeCupy()
    gc = GatherCopy(cp, 0, 7)
    setup: list[str] = []
    cp.cuda.alloc_pinned_memory = lambda n: setup.append("pinned") or bytearray(n)
    _copy(cp, [1000] * MIN_BATCH, gc)
    assert "pinned" in setup  # what the warm-up moves out of the round


def test_a_launch_that_raises_releases_its_ring_slot() -> None:
    cp = FakeCupy()
    gc = GatherCopy(cp, 0, 7)
    gc.warm(64 * TILE_BYTES)
    regions, _ = _tensors(cp, [1000] * MIN_BATCH)
    srcs = np.array([r.ptr for r in regions], dtype=np.uint64)
    dsts = np.uint64(cp.dev.alloc(1000 * MIN_BATCH)) + np.arange(MIN_BATCH, dtype=np.uint64) * 1000
    sizes = np.full(MIN_BATCH, 1000, dtype=np.int64)
    staged = gc.stage(srcs, dsts, sizes, deadline=time.monotonic() + 5, alive=lambda: None)
    assert staged.table is not None and any(gc._staged)

    def lost(*a: object, **k: object) -> None:
        raise RuntimeError("the worker is gone")

    gc._kernel = lost
    with pytest.raises(RuntimeError, match="the worker is gone"):
        gc.launch(staged, deadline=time.monotonic() + 5, alive=lambda: None)
    assert not any(gc._staged)  # a slot held for good would stall the ring for the session


def test_growing_the_tables_waits_behind_the_launches_that_read_the_old_ones() -> None:
    cp = FakeCupy()
    gc = _copy(cp, [1000] * MIN_BATCH)  # tables for a few rows, one launch read them
    cp.log.clear()
    _copy(cp, [100] * 600, gc)  # more rows than the tables hold: they grow first
    first_destroy = next(i for i, e in enumerate(cp.log) if e[0] == "destroy")
    # an event recorded behind everything queued, and waited for, before a table goes
    assert cp.log[first_destroy - 2][:1] == ("record",) and cp.log[first_destroy - 1][0] == "query"
