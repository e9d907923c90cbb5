"""The fused CUDA delta kernel (``trainer.delta_cuda``) against the reference kernels, on a
GPU (``pytest -m gpu tests/gpu/test_delta_cuda_gpu.py``): for random bit patterns of every
element width (bool, float8, bfloat16, float16, float32, float64), odd sizes, empty
tensors, misaligned views, several tensors per group and densities 0, one element, 2 %,
30 % and 100 %, the counts, the patches' int32 indices and values and the base afterwards
are bit-identical to the reference kernel's (the base: to the new bytes), from a torch and
from a JAX caller."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from weightwire.shared.meta import ParamMeta
from weightwire.trainer.delta import DeltaKernel, DeltaTracker

SIZES = (0, 1, 7, 4099, 3 * 16384 + 5, 200_003)
DENSITIES: tuple[float | str, ...] = (0.0, "one", 0.02, 0.3, 1.0)
LIMIT_DENSITY = 0.5  # 30 % goes as a patch, 100 % dense


def _changed(
    rng: np.random.Generator, old: np.ndarray, density: float | str, boolean: bool
) -> np.ndarray:
    """``old`` (raw bits, one unsigned word per element) with some elements' bits flipped."""
    new = old.copy()
    if not old.size:
        return new
    if density == "one":
        picked = np.zeros(old.size, bool)
        picked[rng.integers(old.size)] = True
    else:
        picked = rng.random(old.size) < float(density)
    top = 1 if boolean else np.iinfo(old.dtype).max
    flip = rng.integers(1, top, size=int(picked.sum()), endpoint=True, dtype=old.dtype)
    new[picked] ^= flip
    return new


def _bits(rng: np.random.Generator, width: int, n: int, boolean: bool) -> np.ndarray:
    if boolean:
        return rng.integers(0, 2, n, dtype=np.uint8)
    return rng.integers(0, np.iinfo(f"u{width}").max, n, dtype=f"u{width}", endpoint=True)


def _signed_zeros_and_nans() -> tuple[np.ndarray, np.ndarray]:
    """float32 bits: +0 -> -0, one NaN payload -> another, equal as floats or both NaN."""
    old = np.array([0.0, np.nan, 1.0, -0.0, 2.0] * 41, np.float32)
    new = old.copy()
    new[0::5] = -0.0
    bits = new.view(np.uint32)
    bits[1::5] = 0x7FC00001
    return old.view(np.uint32), new.view(np.uint32)


def _group(rng: np.random.Generator, density: float | str, widths: dict[str, tuple[int, bool]]):
    """Per dtype name and size: (old bits, new bits)."""
    out = []
    for name, (width, boolean) in widths.items():
        for n in SIZES:
            old = _bits(rng, width, n, boolean)
            out.append((name, old, _changed(rng, old, density, boolean)))
    old, new = _signed_zeros_and_nans()
    out.append(("float32", old, new))
    return out


def _run(kernel: DeltaKernel, news: list, bases: list, limits: list[int], host: Any) -> tuple:
    """One group through ``kernel``: counts, each patch's bytes, each base's bytes after."""
    scan = kernel.finish(kernel.start(news, bases, limits))
    patches = {}
    for i, count in enumerate(scan.counts):
        if 0 < count <= limits[i]:
            got = kernel.extract(scan, i, news[i], bases[i])
            bases[i] = got.base
            patches[i] = (host(got.index).tobytes(), host(got.values).tobytes())
        elif count and not scan.updated:
            bases[i] = kernel.refresh(news[i], bases[i])
    kernel.settle()
    return scan.counts, patches, [host(b).tobytes() for b in bases]


def _limits(group: list) -> list[int]:
    tracker = DeltaTracker(None, density=LIMIT_DENSITY, anchor_every=0)  # type: ignore[arg-type]
    return [tracker.limit(ParamMeta("t", "uint8", (old.size,))) for _, old, _ in group]


def _compare(fused: Any, reference: Any, group: list, to_device: Any, host: Any) -> None:
    limits = _limits(group)
    news = [to_device(name, new) for name, _, new in group]
    got = _run(fused, news, [to_device(n, old) for n, old, _ in group], limits, host)
    want = _run(reference, news, [to_device(n, old) for n, old, _ in group], limits, host)
    expected = [np.count_nonzero(old != new) for _, old, new in group]
    assert got[0] == expected and want[0] == expected
    assert got[1].keys() == want[1].keys()
    for i in want[1]:
        assert got[1][i] == want[1][i], (group[i][0], group[i][1].size)
    assert got[2] == [new.tobytes() for _, _, new in group]


TORCH_WIDTHS = {
    "bool": (1, True),
    "float8_e4m3fn": (1, False),
    "bfloat16": (2, False),
    "float16": (2, False),
    "float32": (4, False),
    "float64": (8, False),
}


def _torch() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    pytest.importorskip("cupy")
    return torch


def _jax_gpu() -> tuple[Any, Any]:
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax sees no GPU")
    pytest.importorskip("cupy")
    return jax, gpu


@pytest.mark.gpu
@pytest.mark.parametrize("density", DENSITIES)
def test_torch_fused_matches_reference(density: float | str) -> None:
    _torch_compare(7, density)


def _torch_compare(seed: int, density: float | str) -> None:
    """A group of every torch width through the fused kernel and the reference one."""
    torch = _torch()
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def to_device(name: str, bits: np.ndarray) -> Any:
        t = torch.from_numpy(bits.view(f"i{bits.itemsize}") if bits.itemsize > 1 else bits)
        return t.cuda().view(getattr(torch, name))

    def host(t: Any) -> np.ndarray:
        flat = t.detach().reshape(-1)
        return flat.view(words[flat.element_size()]).cpu().numpy()

    group = _group(np.random.default_rng(seed), density, TORCH_WIDTHS)
    _compare(TorchDeltaKernel("cuda"), TorchDeltaKernel("static"), group, to_device, host)


# Tilings the benchmark sweeps (threads, vec, min_blocks): every one compiles and matches.
TILINGS = [(128, 1, 1), (256, 8, 1), (512, 8, 2), (1024, 16, 1), (256, 16, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("density", [0.02, 0.3, 1.0])
def test_torch_fused_matches_reference_every_tiling(
    tiling: tuple[int, int, int], density: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightwire.trainer import delta_cuda

    monkeypatch.setattr(delta_cuda, "TILING", delta_cuda.Tiling(*tiling))
    _torch_compare(17, density)


@pytest.mark.gpu
def test_torch_fused_misaligned_views_and_huge_tensor() -> None:
    """Views at odd offsets take the element path; a tensor past the int32 index range is
    counted and its base updated, with no patch."""
    torch = _torch()
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    kernel = TorchDeltaKernel("cuda")
    n = 3 * 16384 + 9
    big_new = torch.randint(-(2**15), 2**15, (n + 3,), dtype=torch.int16, device="cuda")
    big_old = big_new.clone()
    big_old[::37] += 1
    new, old = big_new[1 : n + 1].view(torch.bfloat16), big_old[1 : n + 1].view(torch.bfloat16)
    base = old.clone()  # aligned base, misaligned new
    view_base = torch.cat([old[:1], old])[1:]  # misaligned base too
    assert new.data_ptr() % 16 and view_base.data_ptr() % 16
    limit = n // 2
    ref = TorchDeltaKernel("static")
    for b in (base, view_base):
        want_base = b.clone()
        got = _run(kernel, [new], [b], [limit], lambda t: t.view(torch.int16).cpu().numpy())
        want = _run(ref, [new], [want_base], [limit], lambda t: t.view(torch.int16).cpu().numpy())
        assert got == want
    huge = 2**31 + 7
    new_huge = torch.zeros(huge, dtype=torch.uint8, device="cuda")
    new_huge[-5:] = 1
    new_huge[:3] = 2
    base_huge = torch.zeros_like(new_huge)
    scan = kernel.finish(kernel.start([new_huge], [base_huge], [0]))
    kernel.settle()
    assert scan.counts == [8] and scan.updated
    assert torch.equal(base_huge, new_huge)


@pytest.mark.gpu
@pytest.mark.parametrize("density", DENSITIES)
def test_jax_fused_matches_reference(density: float | str) -> None:
    jax, gpu = _jax_gpu()
    import jax.numpy as jnp

    from weightwire.jax_side.delta import JaxDeltaKernel, Prefix

    widths = {k: v for k, v in TORCH_WIDTHS.items() if v[0] < 8}  # no 64-bit without x64
    dtypes = {k: np.dtype(getattr(ml_dtypes, k, k)) for k in widths}
    dtypes["bool"] = np.dtype(bool)

    def to_device(name: str, bits: np.ndarray) -> Any:
        return jax.device_put(jnp.asarray(bits.view(dtypes[name])), gpu)

    def host(x: Any) -> np.ndarray:
        out = x.host() if isinstance(x, Prefix) else np.asarray(x)
        return out.reshape(-1).view(f"u{out.dtype.itemsize}")

    group = _group(np.random.default_rng(11), density, widths)
    _compare(JaxDeltaKernel("cuda"), JaxDeltaKernel("search"), group, to_device, host)


# Several layer groups per launch (``group_bytes``) and several launches in flight
# (``ahead``): the rounds through ``DeltaTracker`` are the reference kernel's, byte for byte.
BATCHED = [(0, 1), (0, 3), (40_000, 1), (40_000, 2), (1 << 30, 1)]


@pytest.mark.gpu
def test_torch_fused_batched_launches_match_reference() -> None:
    torch = _torch()
    from tests.trainer.delta_batches import assert_same_rounds, layered
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32}

    def to_device(dtype: str, bits: np.ndarray) -> Any:
        signed = bits.view(f"i{bits.itemsize}") if bits.itemsize > 1 else bits
        return torch.from_numpy(signed.copy()).cuda().view(getattr(torch, dtype))

    def host(t: Any) -> np.ndarray:
        flat = t.detach().reshape(-1)
        return flat.view(words[flat.element_size()]).cpu().numpy()

    model = layered(np.random.default_rng(3), 6)
    fused, reference = TorchDeltaKernel("cuda"), TorchDeltaKernel("static")
    assert_same_rounds(fused, reference, model, to_device, host, BATCHED)


@pytest.mark.gpu
def test_jax_fused_batched_launches_match_reference() -> None:
    jax, gpu = _jax_gpu()
    import jax.numpy as jnp

    from tests.trainer.delta_batches import assert_same_rounds, layered
    from weightwire.jax_side.delta import JaxDeltaKernel, Prefix

    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "bool": np.bool_}

    def to_device(dtype: str, bits: np.ndarray) -> Any:
        return jax.device_put(jnp.asarray(bits.view(dtypes[dtype])), gpu)

    def host(x: Any) -> np.ndarray:
        out = x.host() if isinstance(x, Prefix) else np.asarray(x)
        return out.reshape(-1).view(f"u{out.dtype.itemsize}")

    model = layered(np.random.default_rng(4), 6)
    fused, reference = JaxDeltaKernel("cuda"), JaxDeltaKernel("search")
    assert_same_rounds(fused, reference, model, to_device, host, BATCHED)


@pytest.mark.gpu
def test_torch_fused_rounds_allocate_nothing_once_warm() -> None:
    """#49: after a session's first delta round, a round's extraction asks torch's caching
    allocator for nothing (no per-round block of a data-dependent size to miss the cache
    and retry on a full card), two rounds built on a stream of their own included (a
    scratch buffer taken there waits for its last use); the bytes stay the reference's."""
    torch = _torch()
    import contextlib

    from tests.trainer.delta_batches import assert_steady_rounds, layered
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    def to_device(dtype: str, bits: np.ndarray) -> Any:
        signed = bits.view(f"i{bits.itemsize}") if bits.itemsize > 1 else bits
        return torch.from_numpy(signed.copy()).cuda().view(getattr(torch, dtype))

    def host(t: Any) -> np.ndarray:
        return t.detach().reshape(-1).view(torch.uint8).cpu().numpy()

    def allocations() -> int:
        return int(torch.cuda.memory_stats()["allocation.all.allocated"])

    side = torch.cuda.Stream()

    @contextlib.contextmanager
    def around(i: int) -> Any:
        if i not in (2, 3):
            yield
            return
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            yield
        main.wait_stream(side)

    model = layered(np.random.default_rng(6), 6)
    fused, reference = TorchDeltaKernel("cuda"), TorchDeltaKernel("static")
    assert_steady_rounds(fused, reference, model, to_device, host, allocations, around)
    assert fused.workspaces[torch.device("cuda", torch.cuda.current_device())].allocations


@pytest.mark.gpu
def test_torch_fused_large_batch_scratch_and_timing() -> None:
    """One launch over many tensors of a few MB (tiles numbered across them all): counts,
    bases and patches right, the scratch released, the device time measured."""
    torch = _torch()
    from weightwire.torch_side.sender.delta import TorchDeltaKernel
    from weightwire.trainer import delta_cuda

    kernel = TorchDeltaKernel("cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    n = 3_000_017
    news = [torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16, device="cuda")
            for _ in range(40)]  # fmt: skip
    olds = [x.clone() for x in news]
    for i, old in enumerate(olds):
        old[i :: 97 + i] += 1
    bases = [o.clone() for o in olds]
    fused = delta_cuda.fused(torch.cuda.current_device())
    fused.timing, fused.scratch_peak = True, 0
    limit = n // 10
    scan = kernel.finish(kernel.start(news, bases, [limit] * len(news)))
    kernel.settle()
    want = [int((o != x).sum()) for o, x in zip(olds, news, strict=True)]
    assert scan.counts == want
    assert fused.scratch_live == 0 and fused.scratch_peak >= len(news) * 6 * limit
    assert fused.device_seconds() > 0
    fused.timing = False
    for i in (0, 17, 39):
        got = kernel.extract(scan, i, news[i], bases[i])
        index = torch.nonzero(olds[i] != news[i]).reshape(-1).to(torch.int32)
        assert torch.equal(got.index, index) and torch.equal(got.values, news[i][index.long()])
    assert all(torch.equal(b, x) for b, x in zip(bases, news, strict=True))
