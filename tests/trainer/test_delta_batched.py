"""Delta launches batched by bytes, on CPU: which layer groups share a launch, and the fused
kernel's host side (tables, scratch layout, pinned buffers, the pack) driven through an
emulation of its CuPy calls (``fused_emulator``): the rounds are the reference kernel's byte
for byte whatever ``group_bytes`` and ``ahead`` are."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.trainer.delta_batches import assert_same_rounds, batch_sizes, layered
from tests.trainer.fused_emulator import Emulator, emulated
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.delta import DeltaTracker, batch_by_bytes

CONFIGS = [(0, 1), (0, 3), (40_000, 1), (40_000, 2), (1 << 30, 1)]
LAYERS = 5


def _groups(sizes: list[tuple[str, int]], budget: int) -> list[list[str]]:
    metas = {n: ParamMeta(n, "uint8", (s,)) for n, s in sizes}
    groups = [[(n, None)] for n, _ in sizes]
    return [[n for n, _ in b] for b in batch_by_bytes(groups, metas, budget)]


def test_batches_join_whole_groups_within_the_budget() -> None:
    sizes = [("a", 10), ("b", 10), ("c", 25), ("d", 5), ("e", 5)]
    assert _groups(sizes, 0) == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert _groups(sizes, 20) == [["a", "b"], ["c"], ["d", "e"]]  # c alone: over the budget
    assert _groups(sizes, 25) == [["a", "b"], ["c"], ["d", "e"]]
    assert _groups(sizes, 55) == [["a", "b", "c", "d", "e"]]
    assert _groups([], 10) == []


def test_layer_groups_stay_whole_in_a_batch() -> None:
    model = layered(np.random.default_rng(0), LAYERS)
    per_layer = batch_sizes(model, 0)
    assert per_layer == [1] + [5] * LAYERS + [2]
    # ~16.5 kB a layer, 10 kB the embedding and the tail: embed + layer 0, then two layers each.
    assert batch_sizes(model, 40_000) == [6, 10, 10, 2]
    assert batch_sizes(model, 1 << 30) == [len(model)]


def test_tracker_refuses_bad_knobs() -> None:
    with pytest.raises(ConfigError, match="group_bytes >= 0 and ahead >= 1"):
        DeltaTracker(None, density=0.5, anchor_every=0, group_bytes=-1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="group_bytes >= 0 and ahead >= 1"):
        DeltaTracker(None, density=0.5, anchor_every=0, ahead=0)  # type: ignore[arg-type]


def test_torch_fused_batches_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

    def to_device(dtype: str, bits: np.ndarray) -> Any:
        signed = bits.view(f"i{bits.itemsize}") if bits.itemsize > 1 else bits
        return torch.from_numpy(signed.copy()).view(getattr(torch, dtype))

    def host(t: Any) -> np.ndarray:
        flat = t.detach().reshape(-1)
        return flat.view(words[flat.element_size()]).numpy()

    emulator = Emulator()
    monkeypatch.setattr(TorchDeltaKernel, "fused_type", "cpu")
    monkeypatch.setattr(TorchDeltaKernel, "_stream", staticmethod(lambda device: 0))
    model = layered(np.random.default_rng(1), LAYERS)
    with emulated(monkeypatch, emulator):
        fused = TorchDeltaKernel("cuda")
        reference = TorchDeltaKernel("static")
        assert_same_rounds(fused, reference, model, to_device, host, CONFIGS)
        kernel = emulator.fused()
    assert emulator.launches[: len(batch_sizes(model, 0))] == batch_sizes(model, 0)
    assert emulator.launches[-1] == len(model)  # the last config: one launch
    # The counts' pinned buffers are reused across launches and rounds.
    assert emulator.pinned_allocs <= 4 + max(a for _, a in CONFIGS)
    del kernel


def test_fused_scratch_is_released_and_its_peak_known(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from weightwire.torch_side.sender.delta import TorchDeltaKernel
    from weightwire.trainer import delta_cuda

    emulator = Emulator()
    monkeypatch.setattr(TorchDeltaKernel, "fused_type", "cpu")
    monkeypatch.setattr(TorchDeltaKernel, "_stream", staticmethod(lambda device: 0))
    with emulated(monkeypatch, emulator):
        kernel = TorchDeltaKernel("cuda")
        n, limit = 50_000, 10_000
        news = [torch.arange(n, dtype=torch.int16).view(torch.bfloat16) for _ in range(2)]
        bases = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
        fused = delta_cuda.fused(0)
        fused.timing = True
        scan = kernel.finish(kernel.start(news, bases, [n, limit]))  # a patch, then dense
        assert scan.counts == [n - 1, n - 1] and scan.updated  # element 0 is 0 in both
        assert fused.scratch_live == 0
        # Each tensor's region: its limit's int32 indices and bf16 values (16-byte aligned).
        assert fused.scratch_peak >= (4 * n + 2 * n) + (4 * limit + 2 * limit)
        assert fused.device_seconds() == pytest.approx(1e-3)  # one launch, one pack: 0.5 ms each
        got = kernel.extract(scan, 0, news[0], bases[0])
        assert torch.equal(got.index, torch.arange(1, n, dtype=torch.int32))
        assert torch.equal(got.values.view(torch.int16), torch.arange(1, n, dtype=torch.int16))
        assert all(
            torch.equal(b.view(torch.int16), x.view(torch.int16))
            for b, x in zip(bases, news, strict=True)
        )


def test_jax_fused_batches_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import ml_dtypes

    from weightwire.jax_side.delta import JaxDeltaKernel, Prefix
    from weightwire.jax_side.delta_cuda import JaxFused

    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "bool": np.bool_}

    def to_device(dtype: str, bits: np.ndarray) -> Any:
        return jax.device_put(jnp.asarray(bits.view(dtypes[dtype])), jax.devices("cpu")[0])

    def host(x: Any) -> np.ndarray:
        out = x.host() if isinstance(x, Prefix) else np.asarray(x)
        return out.reshape(-1).view(f"u{out.dtype.itemsize}")

    emulator = Emulator()
    model = layered(np.random.default_rng(2), LAYERS)
    with emulated(monkeypatch, emulator):
        fused = JaxDeltaKernel("search")
        fused._fused = JaxFused(emulator.cupy)
        fused._fused.platform = "cpu"
        assert_same_rounds(fused, JaxDeltaKernel("search"), model, to_device, host, CONFIGS)
    assert emulator.launches[-1] == len(model)


def test_jax_fused_patches_describe_as_the_tensors_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused outputs are CuPy-made unsigned words (CuPy has no bfloat16): each patch
    still describes itself, and reads back, as the tensor's dtype."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import ml_dtypes

    from weightwire.jax_side.delta import JaxDeltaKernel
    from weightwire.jax_side.delta_cuda import JaxFused

    cpu = jax.devices("cpu")[0]
    old = np.arange(100, dtype=np.float32).astype(ml_dtypes.bfloat16)
    new = old.copy()
    new[[3, 50, 99]] = ml_dtypes.bfloat16(-1.5)
    emulator = Emulator()
    with emulated(monkeypatch, emulator):
        kernel = JaxDeltaKernel("search")
        kernel._fused = JaxFused(emulator.cupy)
        kernel._fused.platform = "cpu"
        news = [jax.device_put(jnp.asarray(new), cpu)]
        bases = [jax.device_put(jnp.asarray(old), cpu)]
        scan = kernel.finish(kernel.start(news, bases, [50]))
        got = kernel.extract(scan, 0, news[0], bases[0])
    # What JAXTrainerEngine.describe answers for a patch (names the wire dtype in the plan).
    assert got.values.describe() == ("bfloat16", (3,))
    assert got.index.describe() == ("int32", (3,))
    assert got.values.host().dtype == ml_dtypes.bfloat16
    assert got.values.host().tolist() == [-1.5, -1.5, -1.5]
    assert got.index.host().tolist() == [3, 50, 99]


def test_torch_fused_rounds_allocate_nothing_once_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    """#49: per-round device allocations of data-dependent sizes (the patches' outputs) made
    the caching allocator retry on a full card, by turns. After the session's first delta
    round the fused path's scratch and outputs come from its workspace: no ``torch.empty``
    in a round's extraction, whatever its changed fraction; the bytes stay the reference's."""
    torch = pytest.importorskip("torch")
    from tests.trainer.delta_batches import assert_steady_rounds
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    def tensor(dtype: str, bits: np.ndarray) -> Any:
        signed = bits.view(f"i{bits.itemsize}") if bits.itemsize > 1 else bits
        return torch.from_numpy(signed.copy()).view(getattr(torch, dtype))

    monkeypatch.setattr(TorchDeltaKernel, "fused_type", "cpu")
    monkeypatch.setattr(TorchDeltaKernel, "_stream", staticmethod(lambda device: 0))
    allocated: list[int] = []
    empty = torch.empty

    def counting(*args: Any, **kwargs: Any) -> Any:
        got = empty(*args, **kwargs)
        if got.numel():
            allocated.append(got.numel())
        return got

    def host(t: Any) -> np.ndarray:
        return t.detach().reshape(-1).view(torch.uint8).numpy()

    monkeypatch.setattr(torch, "empty", counting)
    with emulated(monkeypatch, Emulator()):
        fused = TorchDeltaKernel("cuda")
        model = layered(np.random.default_rng(3), LAYERS)
        reference = TorchDeltaKernel("static")
        assert_steady_rounds(fused, reference, model, tensor, host, allocated.__len__)
    workspace = fused.workspaces[torch.device("cpu")]
    assert workspace.scratch_bytes > 0 and workspace.allocations >= 3  # 2 scratch + the arenas


def test_dense_round_refreshes_the_held_base_in_place() -> None:
    """An anchor or forced dense round copies into the base it holds (no new copy of the
    model each dense round); a tensor whose shape changed, or a base dropped by a failed
    round, is copied anew. The base is the new bytes either way."""
    torch = pytest.importorskip("torch")
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    tracker = DeltaTracker(TorchDeltaKernel("static"), density=0.5, anchor_every=0)
    w0 = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(4, dtype=torch.bfloat16)}
    metas = [ParamMeta("a", "float32", (6,)), ParamMeta("b", "bfloat16", (4,))]
    assert [n for n, _ in tracker.snapshot_stream(w0.items(), metas)] == ["a", "b"]
    held = dict(tracker.bases)
    assert held["a"] is not w0["a"] and torch.equal(held["a"], w0["a"])
    w1 = {"a": w0["a"] + 1, "b": torch.zeros(5, dtype=torch.bfloat16)}
    metas[1] = ParamMeta("b", "bfloat16", (5,))
    list(tracker.snapshot_stream(w1.items(), metas))
    assert tracker.bases["a"] is held["a"]  # in place
    assert tracker.bases["b"] is not held["b"] and tracker.bases["b"].shape == (5,)
    assert all(torch.equal(tracker.bases[n], w1[n]) for n in w1)
    assert tracker.metas == metas
    tracker.drop()  # a failed round
    list(tracker.snapshot_stream(w1.items(), metas))
    assert tracker.bases["a"] is not held["a"] and torch.equal(tracker.bases["a"], w1["a"])


def test_jax_fused_scratch_is_kept_across_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The JAX caller's launch scratch (the largest allocations of a round: its patch
    limits' slots) is a ring kept for the session; only its patches come from CuPy's pool
    each round (they reach JAX as arrays). The bytes stay the reference's."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import ml_dtypes

    from tests.trainer.delta_batches import assert_steady_rounds
    from weightwire.jax_side.delta import JaxDeltaKernel, Prefix
    from weightwire.jax_side.delta_cuda import JaxFused

    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "bool": np.bool_}

    def to_device(dtype: str, bits: np.ndarray) -> Any:
        return jax.device_put(jnp.asarray(bits.view(dtypes[dtype])), jax.devices("cpu")[0])

    def host(x: Any) -> np.ndarray:
        out = x.host() if isinstance(x, Prefix) else np.asarray(x)
        return out.reshape(-1).view(np.uint8)

    emulator = Emulator()
    with emulated(monkeypatch, emulator):
        fused = JaxDeltaKernel("search")
        fused._fused = JaxFused(emulator.cupy)
        fused._fused.platform = "cpu"

        def scratch_allocations() -> int:
            return sum(r.allocations for r in fused._fused._scratch.values())

        model = layered(np.random.default_rng(5), LAYERS)
        reference = JaxDeltaKernel("search")
        assert_steady_rounds(fused, reference, model, to_device, host, scratch_allocations)
    assert scratch_allocations()  # the first round's, each launch larger than the last


def test_workspace_arenas_carve_overflow_and_grow() -> None:
    """The output arenas: a round's launches are carved one after another; a round larger
    than the arena (the first, or more changed than any before) packs the rest into buffers
    of their own and the arena grows to it plus a quarter at ``settle``; ``begin`` and
    ``settle`` rewind. Scratch buffers are the largest launch's size, reused in turn."""
    torch = pytest.importorskip("torch")
    from weightwire.torch_side.sender.delta import ARENA_HEADROOM, Workspace

    ws = Workspace(torch.device("cpu"))
    first = [ws.outputs("index", torch.int32, n) for n in (100, 60)]
    assert ws.allocations == 2 and first[0].data_ptr() != first[1].data_ptr()  # no arena yet
    ws.settle()
    arena_size = ws._arenas["index"].numel()
    assert arena_size >= 160 * ARENA_HEADROOM and ws.allocations == 3
    ws.begin()
    a, b = ws.outputs("index", torch.int32, 100), ws.outputs("index", torch.int32, 60)
    assert ws.allocations == 3  # carved: the arena, then right behind the first
    assert b.data_ptr() == a.data_ptr() + 100 * 4 == ws._arenas["index"].data_ptr() + 400
    over = ws.outputs("index", torch.int32, arena_size)  # past the arena's end
    assert ws.allocations == 4 and over.numel() == arena_size
    ws.settle()
    assert ws._arenas["index"].numel() >= (160 + arena_size) * ARENA_HEADROOM
    assert ws.allocations == 5
    ws.begin()
    assert ws.outputs("index", torch.int32, 0).numel() == 0 and ws.allocations == 5
    # Scratch: the largest launch's size, given back and taken again without allocating.
    p1, s1 = ws.scratch(1000, 0)
    p2, s2 = ws.scratch(3000, 0)  # larger: every buffer from now on is 3000
    ws.give_back(s1, 0)  # outgrown: dropped
    ws.give_back(s2, 0)
    p3, s3 = ws.scratch(500, 0)
    assert p3 == p2 and s3.numel() == 3000 and ws.allocations == 7
