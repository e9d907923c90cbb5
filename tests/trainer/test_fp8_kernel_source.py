"""The fused FP8 block quantizer's CUDA source (``trainer.fp8_cuda_source``), on CPU.

The source itself, compiled as host C++ (``g++``; skipped without it): CUDA's block index
becomes a loop and the source's ``#ifndef __CUDA_ARCH__`` twin runs each block's threads
in turn (the same per-thread index math, loads, scales and conversions; the maximum of
their partial maxima for the warp shuffles). Its tiles' bytes and scales against
``quantize_block_reference`` (vLLM's ``per_block_cast_to_fp8``): random and real-shaped
weights, uneven edges, tiny values near the amax floor, all-zero blocks, ue8m0 on and off,
bfloat16 / float16 / float32 inputs, values that tie in e4m3, several weights of one
launch, strided rows, unaligned pointers (the element path); the amaxes it writes flag NaN
and inf. And its float32 -> e4m3 conversion (``ww_e4m3``) against torch's CPU cast over a
sweep of float32 bit patterns in [-464, 464] with every e4m3 tie point and subnormal
boundary, and on every positive float32 up to 464. ``launch_fp8`` driving this kernel
(the torch glue): ``test_fp8_fused_glue.py``; on a GPU: ``tests/gpu/test_fp8_kernel_gpu.py``.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from weightwire.shared.quant import FP8_MAX, Fp8Block, quantize_block_reference
from weightwire.trainer.fp8_cuda import BlockJob, block_table
from weightwire.trainer.fp8_cuda_source import KERNELS, SOURCE

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}

_HOST = r"""
#include <string.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__
#define __launch_bounds__(...)
struct ww_dim { unsigned x; };
static ww_dim blockIdx, threadIdx, blockDim, gridDim;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline uint2 make_uint2(unsigned x, unsigned y) { uint2 r = {x, y}; return r; }
static unsigned int __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
"""
_RUN = r"""
extern "C" void run_$NAME(const long long* table, int rows, long long tiles, int grid) {
    gridDim.x = grid;
    for (unsigned b = 0; b < (unsigned)grid; ++b) { blockIdx.x = b; $NAME(table, rows, tiles); }
}
"""
_CONVERT = r"""
extern "C" void convert(const float* x, unsigned char* out, long long n) {
    for (long long i = 0; i < n; ++i) out[i] = ww_e4m3(x[i]);
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return host_library(tmp_path_factory.mktemp("fp8_kernel"))


def host_library(tmp: Path) -> Any:
    """The kernels' source, as ``fp8_cuda`` hands it to NVRTC, built by the host's C++
    compiler, with a runner per kernel (the grid as a loop) and ``convert`` (``ww_e4m3``
    over an array)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this host to compile the kernel's source")
    parts = [_HOST, SOURCE, _CONVERT]
    parts += [_RUN.replace("$NAME", name) for name in KERNELS.values()]
    source, lib = tmp / "fp8.cpp", tmp / "fp8.so"
    source.write_text("\n".join(parts))
    subprocess.run(
        ["g++", "-O2", "-std=c++17", "-ffp-contract=off", "-fno-strict-aliasing", "-shared",
         "-fPIC", "-o", str(lib), str(source)],
        check=True,
        timeout=300,
    )  # fmt: skip
    return ctypes.CDLL(str(lib))


class Quantized:
    """One weight's outputs from a host launch."""

    def __init__(self, m: int, n: int, block: tuple[int, int]) -> None:
        rows, cols = -(-m // block[0]), -(-n // block[1])
        self.weight = np.full((m, n), 0xAB, dtype=np.uint8)  # every byte must be written
        self.scale = np.full((rows, cols), np.nan, dtype=np.float32)
        self.amax = np.full((rows, cols), np.nan, dtype=np.float32)


def run(
    lib: Any,
    weights: list[tuple[np.ndarray, Fp8Block]],
    *,
    grid: int | None = None,
    ld: list[int] | None = None,
) -> list[Quantized]:
    """Quantize ``weights`` (one dtype) with one host launch; ``ld``: each source's row
    stride in elements when it is a view of wider rows."""
    outs, jobs = [], []
    for i, (x, scheme) in enumerate(weights):
        m, n = x.shape
        out = Quantized(m, n, scheme.block)
        outs.append(out)
        stride = ld[i] if ld else x.strides[0] // x.itemsize
        assert x.strides[1] == x.itemsize
        jobs.append(
            BlockJob(
                x.ctypes.data, out.weight.ctypes.data, out.scale.ctypes.data,
                out.amax.ctypes.data, m, n, stride, x.dtype.name, scheme.block, scheme.ue8m0,
            )
        )  # fmt: skip
    table, tiles = block_table(jobs)
    kernel = getattr(lib, f"run_{KERNELS[weights[0][0].dtype.name]}")
    kernel(
        table.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_int(len(jobs)),
        ctypes.c_longlong(tiles),
        ctypes.c_int(grid or tiles),
    )
    return outs


def assert_reference(out: Quantized, x: np.ndarray, scheme: Fp8Block, what: str = "") -> None:
    want_q, want_scale = quantize_block_reference("w.weight", x, scheme)
    assert out.scale.tobytes() == want_scale.tobytes(), f"scales differ {what}"
    diff = np.flatnonzero(out.weight.reshape(-1) != want_q.view(np.uint8).reshape(-1))
    assert not diff.size, f"{diff.size} bytes differ {what}, first at {diff[0]}"


def _ties() -> np.ndarray:
    """Every e4m3 value and every midpoint between neighbours (the ties), both signs,
    scaled for a block whose amax is 448 (its scale 1.0: the products are the values)."""
    e4m3 = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = (e4m3[:-1] + e4m3[1:]) / 2  # exact in float32 (and in bfloat16: 5 bits)
    values = np.concatenate([e4m3, mids, [np.float32(FP8_MAX)]])
    return np.concatenate([values, -values]).astype(np.float32)


def _weight(rng: np.random.Generator, shape: tuple[int, int], dtype: str, kind: str) -> np.ndarray:
    m, n = shape
    if kind == "ties":
        x = np.resize(_ties(), m * n).reshape(m, n)
        x[0, 0] = FP8_MAX  # every block's amax 448 for the non-ue8m0 scale 1.0
        x[::128, ::128] = FP8_MAX
    elif kind == "tiny":  # amaxes about the 1e-4 floor, and subnormal inputs
        x = rng.standard_normal(shape) * 3e-5
        x[1::3, ::5] = 1e-40 if dtype != "float16" else 3e-8
    elif kind == "zeros":
        x = rng.standard_normal(shape) * 0.02
        x[: min(m, 128), :] = 0.0
        x[:, -3:] = -0.0
    elif kind == "ue8m0_edge":  # amaxes 448 2^k (1 + a few ulps): ue8m0's log2 edge
        x = rng.standard_normal(shape) * 0.01
        top = np.float32(FP8_MAX * 2.0**-8).view(np.uint32) + np.arange(9, dtype=np.uint32)
        x[::7, ::5] = np.resize(top.view(np.float32), x[::7, ::5].shape)
    else:
        x = rng.standard_normal(shape) * 0.02
    if dtype == "float16":
        x = np.clip(x, -6e4, 6e4)
    return np.ascontiguousarray(x.astype(DTYPES[dtype]))


KINDS = ["normal", "ties", "tiny", "zeros", "ue8m0_edge"]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_kernels_source_gives_the_references_bytes_and_scales(
    lib: Any, dtype: str, ue8m0: bool
) -> None:
    # one launch: whole 128-blocks (the register path) and ragged edges (the element path)
    rng = np.random.default_rng(5)
    scheme = Fp8Block(ue8m0=ue8m0)
    shapes = [(256, 384), (448, 330), (130, 200), (1, 7), (129, 128)]
    for kind in KINDS:
        weights = [(_weight(rng, s, dtype, kind), scheme) for s in shapes]
        for out, (x, _) in zip(run(lib, weights), weights, strict=True):
            assert_reference(out, x, scheme, f"{dtype} {kind} {x.shape} ue8m0={ue8m0}")
            assert np.isfinite(out.amax).all()


@pytest.mark.parametrize(
    "block", [(16, 8), (8, 32), (1, 128), (128, 1), (64, 256), (256, 128), (8, 384)]
)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_other_block_shapes_and_a_grid_smaller_than_the_tiles(
    lib: Any, block: tuple[int, int], dtype: str
) -> None:
    # (256, 128) of float32 does not fit the registers: every tile on the element path
    rng = np.random.default_rng(6)
    scheme = Fp8Block(block, ue8m0=block[0] == 16)
    weights = [(_weight(rng, (300, 260), dtype, k), scheme) for k in ("normal", "ties")]
    for out, (x, _) in zip(run(lib, weights, grid=7), weights, strict=True):
        assert_reference(out, x, scheme, f"{dtype} {block}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_strided_rows_and_an_unaligned_pointer(lib: Any, dtype: str) -> None:
    rng = np.random.default_rng(8)
    scheme = Fp8Block()
    wide = _weight(rng, (256, 400), dtype, "normal")
    view = wide[:, 8:264]  # rows 400 apart, 16-byte aligned: the register path
    shifted = wide.reshape(-1)[1 : 1 + 256 * 256].reshape(256, 256)  # unaligned: elements
    for x in (view, shifted):
        (out,) = run(lib, [(x, scheme)])
        assert_reference(out, np.ascontiguousarray(x), scheme, f"{dtype} {x.strides}")


def test_a_real_shaped_weight(lib: Any) -> None:
    # a Llama-3-8B k_proj (1024 x 4096) and a DeepSeek-like 7168 x 2112 slice, scaled down
    rng = np.random.default_rng(9)
    for shape in ((1024, 4096), (896, 2112)):
        x = _weight(rng, shape, "bfloat16", "normal")
        for ue8m0 in (False, True):
            (out,) = run(lib, [(x, Fp8Block(ue8m0=ue8m0))])
            assert_reference(out, x, Fp8Block(ue8m0=ue8m0), f"{shape}")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_non_finite_value_shows_in_its_blocks_amax_only(lib: Any, dtype: str, bad: float) -> None:
    x = np.full((300, 260), 0.5, dtype=DTYPES[dtype])
    x[200, 3] = bad  # a whole tile (the register path)
    x[299, 259] = bad  # the ragged corner (the element path)
    (out,) = run(lib, [(x, Fp8Block())])
    finite = np.isfinite(out.amax)
    assert not finite[1, 0] and not finite[2, 2]
    assert finite.sum() == finite.size - 2
    if np.isnan(bad):
        assert np.isnan(out.amax[1, 0])


def _sweep() -> np.ndarray:
    """float32 bit patterns in [0, 464]: a dense stride through them, every e4m3 value
    and tie point with its neighbours a few ulps either side, the subnormal boundaries
    (2^-10, 2^-9 .. 2^-6) likewise, and float32 subnormals."""
    top = np.float32(464.0).view(np.uint32)
    strided = np.arange(0, int(top), 997, dtype=np.uint32)
    ties = _ties()
    ties = ties[ties >= 0]
    edges = np.float32(2.0) ** np.arange(-12, -5, dtype=np.float32)
    centre = np.concatenate([ties, edges, [np.float32(464.0)]]).view(np.uint32)
    near = (centre[:, None].astype(np.int64) + np.arange(-4, 5)).reshape(-1)
    near = near[(near >= 0) & (near <= int(top))].astype(np.uint32)
    subnormal = np.arange(0, 1 << 23, 4099, dtype=np.uint32)
    return np.unique(np.concatenate([strided, near, subnormal, [top]]))


def test_the_e4m3_conversion_is_torchs_cast_over_a_sweep_of_float32(lib: Any) -> None:
    positive = _sweep()
    bits = np.concatenate([positive, positive | np.uint32(0x80000000)])
    x = bits.view(np.float32)
    got = np.empty(x.size, dtype=np.uint8)
    lib.convert(
        x.ctypes.data_as(ctypes.c_void_p),
        got.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_longlong(x.size),
    )
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    diff = np.flatnonzero(got != want)
    assert not diff.size, (
        f"{diff.size} differ, first {x[diff[0]]!r}: {got[diff[0]]:#x} vs {want[diff[0]]:#x}"
    )
    assert x.size > 2_000_000


def test_the_e4m3_conversion_saturates_past_464_and_keeps_nan(lib: Any) -> None:
    x = np.array([464.0001, 479.0, 1e9, np.inf, -np.inf, np.nan], dtype=np.float32)
    got = np.empty(x.size, dtype=np.uint8)
    lib.convert(
        x.ctypes.data_as(ctypes.c_void_p),
        got.ctypes.data_as(ctypes.c_void_p),
        ctypes.c_longlong(x.size),
    )
    # the reference's clip to 448 (torch's unclipped cast gives NaN there: no block product
    # comes near 464)
    assert got.tolist()[:5] == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    assert got[5] & 0x7F == 0x7F


def test_the_source_compiles_for_hopper_with_cupys_flush_to_zero(tmp_path: Path) -> None:
    """Where ``nvcc`` is installed (no GPU needed): the CUDA branch (warp shuffles, shared
    memory, inline PTX) builds for sm_90 under ``-ftz=true`` as CuPy passes it to NVRTC,
    with the hardware pair conversion, at most a few spilled words, and the scale's division
    and the products unflushed IEEE ops."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on this host")
    source = tmp_path / "fp8.cu"
    source.write_text(SOURCE)
    ptx = tmp_path / "fp8.ptx"
    flags = ["-arch=sm_90", "-std=c++17", "-ftz=true"]
    subprocess.run(["nvcc", *flags, "-ptx", "-o", str(ptx), str(source)], check=True, timeout=300)
    text = ptx.read_text()
    ops = re.findall(r"\b(?:mul|div|fma)\.[a-z0-9.]*f32\b", text)
    assert "div.rn.f32" in ops and "mul.rn.f32" in ops
    assert not [op for op in ops if "ftz" in op or op.startswith("fma")], sorted(set(ops))
    built = subprocess.run(
        ["nvcc", *flags, "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "fp8.cubin"), str(source)],
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    # the 2-byte kernels are bounded to 3 blocks per SM (faster on an H100 though ptxas
    # spills a few words at that bound); the float32 one is unbounded and spills nothing
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", built.stderr)]
    assert len(spills) == len(KERNELS) and max(spills) <= 32 and 0 in spills, built.stderr
    assert "cvt.rn.satfinite.e4m3x2.f32" in text  # sm_89+: the hardware pair conversion


def test_the_e4m3_conversion_is_torchs_cast_on_every_float32_up_to_464(lib: Any) -> None:
    # every pattern of [0, 464] (1.14e9, a few seconds in chunks); the sign bit is one OR,
    # checked on the sweep above
    top = int(np.float32(464.0).view(np.uint32))
    chunk = 1 << 24
    got = np.empty(chunk, dtype=np.uint8)
    for start in range(0, top + 1, chunk):
        bits = np.arange(start, min(start + chunk, top + 1), dtype=np.uint32)
        x = bits.view(np.float32)
        out = got[: x.size]
        lib.convert(
            x.ctypes.data_as(ctypes.c_void_p),
            out.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_longlong(x.size),
        )
        want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        diff = np.flatnonzero(out != want)
        assert not diff.size, f"{x[diff[0]]!r}: {out[diff[0]]:#x} vs {want[diff[0]]:#x}"
