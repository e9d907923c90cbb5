"""The pull path's one-time set-up (kernel compile + module load, tables) happens at the
join, so a first round beside a training step makes none of those context-wide calls."""

from tests.backends.test_ipc_gather import MIN_BATCH, FakeCupy, GatherCopy, _copy
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
