"""The batched strided / casting copy of ``weightwire_ipc`` write-through, on CPU.

A chunk's landings that are not contiguous runs go as one launch per dtype pair, driven by
a table (``kernels.batch_table``). Here: the table's rows and tiles, the kernel's index math
and conversions (``kernels.reference_batch``, numpy) against an independent copy of each
landing (numpy views and ml_dtypes casts), and ``StridedCopy.launch_all`` on a fake CUDA
runtime whose kernels run those numpy references over one emulated device memory: one
launch per dtype pair, the table uploaded from pinned memory on the fill stream, a repeated
table launched again without an upload, and the same bytes as one launch per landing.
And the kernels' CUDA sources themselves, both the per-landing and the batched one of every
dtype pair, compiled as host C++ (``g++``; skipped without it) with the thread indices as
loops, against the same independent copy (ties, subnormals, overflow included). On a GPU:
``tests/gpu/test_ipc_strided_batch_gpu.py``.
"""

from __future__ import annotations

import ctypes
import math
from contextlib import nullcontext
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from weightwire.backends.ipc.through import kernels
from weightwire.backends.ipc.through import table as through_table
from weightwire.backends.ipc.through.kernels import (
    ROW,
    TILE,
    StridedCopy,
    batch_table,
    convert_like_kernel,
    geometry_row,
    reference_batch,
)
from weightwire.backends.ipc.through.table import (
    Alloc,
    Land,
    LandingTable,
    ParamSlot,
    Strided,
    TensorLands,
    plan_copies,
)
from weightwire.shared.dtypes import WIRE_DTYPES
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta

H = bytes(range(64))
ARENA = 1 << 20
PARAM_AT = 1 << 19
"""The emulated device memory: the round's tensors from 0, the parameters' allocation here."""


def _case(src: str, dst: str) -> tuple[list[ParamMeta], LandingTable]:
    """Landings that are no contiguous run, as a vLLM layout makes them: q / k / v rows of a
    fused qkv too short to run, gate / up into a fused gate_up, a TP rank's column slice of
    a row-parallel weight, a transposed tensor, a whole norm cast, an expert larger than a
    tile, an empty tensor."""
    metas = [
        ParamMeta("q", src, (8, 6)),
        ParamMeta("k", src, (4, 6)),
        ParamMeta("v", src, (4, 6)),
        ParamMeta("gate", src, (10, 4)),
        ParamMeta("up", src, (10, 4)),
        ParamMeta("o", src, (6, 16)),  # this rank serves columns 8..15
        ParamMeta("t", src, (5, 7)),  # stored transposed
        ParamMeta("norm", src, (6,)),
        ParamMeta("expert", src, (3, TILE + 5)),
        ParamMeta("empty", src, (0, 4)),
    ]
    item = WIRE_DTYPES[dst].itemsize
    sizes = {"qkv": 16 * 6, "gate_up": 20 * 4, "o": 6 * 8, "t": 35, "norm": 6}
    sizes |= {"expert": 3 * (TILE + 5), "empty": 1}
    params, at = [], 0
    for name, n in sizes.items():
        params.append(ParamSlot(name, 0, at, n * item, dst))
        at += -(-n * item // 64) * 64
    lands = [
        Land(0, (8, 6), 0, (6, 1), 0, (6, 1)),
        Land(0, (4, 6), 0, (6, 1), 48, (6, 1)),
        Land(0, (4, 6), 0, (6, 1), 72, (6, 1)),
        Land(1, (10, 4), 0, (4, 1), 0, (4, 1)),
        Land(1, (10, 4), 0, (4, 1), 40, (4, 1)),
        Land(2, (6, 8), 8, (16, 1), 0, (8, 1)),
        Land(3, (5, 7), 0, (7, 1), 0, (1, 5)),
        Land(4, (6,), 0, (1,), 0, (1,)),
        Land(5, (3, TILE + 5), 0, (TILE + 5, 1), 0, (TILE + 5, 1)),
        Land(6, (0, 4), 0, (4, 1), 0, (4, 1)),
    ]
    tensors = tuple(TensorLands(m.name, (x,)) for m, x in zip(metas, lands, strict=True))
    return metas, LandingTable((Alloc(H, at),), tuple(params), tensors)


_SPECIAL = [
    0.0,
    -0.0,
    np.inf,
    1e-40,  # a float32 subnormal
    1 + 2**-8,  # ties in bfloat16: to even, down ...
    1 + 3 * 2**-8,  # ... and up
    1 + 2**-11,  # ties in float16
    1 + 3 * 2**-11,
    1 + 2**-8 + 2**-30,  # float64 -> bfloat16: a tie once narrowed to float32 (down), not before
    65520.0,  # float16 overflows to infinity
    -3.0000001,
]


def _sources(
    metas: list[ParamMeta],
    rng: np.random.Generator,
    arena: int = ARENA,
    param_at: int = PARAM_AT,
) -> tuple[np.ndarray, list[int]]:
    """The emulated memory with every tensor's values (finite, signed zeros, infinities,
    subnormals, values that round), and each tensor's offset in it."""
    memory = np.zeros(arena, dtype=np.uint8)
    offsets, at = [], 0
    for m in metas:
        dtype = WIRE_DTYPES[m.dtype].numpy
        if np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16:
            values = (rng.standard_normal(m.numel) * 3).astype(np.float64)
            n = min(len(_SPECIAL), m.numel)
            values[:n] = _SPECIAL[:n]
            with np.errstate(over="ignore"):  # 65520 into float16: infinity, as the device
                raw = values.astype(dtype).view(np.uint8)
        else:
            raw = rng.integers(0, 256, m.numel * WIRE_DTYPES[m.dtype].itemsize, dtype=np.uint8)
            if m.dtype == "bool":
                raw &= 1
        memory[at : at + raw.size] = raw
        offsets.append(at)
        at += -(-raw.size // 64) * 64
    assert at < param_at
    return memory, offsets


def _expected(
    memory: np.ndarray,
    offsets: list[int],
    metas: list[ParamMeta],
    table: LandingTable,
    param_at: int = PARAM_AT,
) -> np.ndarray:
    """Each landing copied alone with numpy views, cast as torch's ``copy_`` (float64 through
    float32 into a 16-bit dtype)."""
    out = memory.copy()
    for meta, at, t in zip(metas, offsets, table.tensors, strict=True):
        src_dtype = WIRE_DTYPES[meta.dtype].numpy
        src = memory[at : at + meta.numel * src_dtype.itemsize].view(src_dtype)
        for land in t.lands:
            slot = table.params[land.param]
            dst_dtype = WIRE_DTYPES[slot.dtype].numpy
            base = param_at + slot.offset
            dst = out[base : base + slot.nbytes].view(dst_dtype)
            s = np.lib.stride_tricks.as_strided(
                src[land.src_offset :],
                land.shape,
                [x * src_dtype.itemsize for x in land.src_strides],
            )
            d = np.lib.stride_tricks.as_strided(
                dst[land.dst_offset :],
                land.shape,
                [x * dst_dtype.itemsize for x in land.dst_strides],
                writeable=True,
            )
            if meta.dtype == "float64" and slot.dtype in ("bfloat16", "float16"):
                s = s.astype(np.float32)
            with np.errstate(over="ignore"):
                d[...] = s.astype(dst_dtype)
    return out


def _jobs(metas: list[ParamMeta], table: LandingTable) -> list[Strided]:
    copies = plan_copies(table, metas)
    assert not any(c.runs for c in copies)  # every landing here is a kernel copy
    return [j for c in copies for j in c.strided]


PAIRS = [
    ("bfloat16", "bfloat16"),
    ("float32", "bfloat16"),
    ("float32", "float16"),
    ("float64", "bfloat16"),
    ("float64", "float32"),
    ("bfloat16", "float32"),
    ("float16", "float64"),
    ("int8", "int8"),
    ("bool", "bool"),
    ("float8_e4m3fn", "float8_e4m3fn"),
]


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_one_batched_table_writes_what_each_landing_alone_writes(
    monkeypatch: pytest.MonkeyPatch, src: str, dst: str
) -> None:
    # same-dtype landings that run together are gather rows: here every one is a kernel copy
    monkeypatch.setattr(through_table, "_runs", lambda *a: None)
    metas, table = _case(src, dst)
    memory, offsets = _sources(metas, np.random.default_rng(7))
    jobs = _jobs(metas, table)
    by_tensor = iter(offsets)
    items = []
    for c in plan_copies(table, metas):
        at = next(by_tensor)
        for j in c.strided:
            item = WIRE_DTYPES[j.src_dtype].itemsize
            items.append((geometry_row(j), at + j.src_offset * item, PARAM_AT + j.dst))
    assert len(items) == len(jobs) == len(metas)
    rows_table, rows, tiles = batch_table(items)
    assert rows == len(metas) - 1  # the empty tensor takes no row
    assert tiles == (len(metas) - 2) + math.ceil(3 * (TILE + 5) / TILE)
    got = memory.copy()
    reference_batch(rows_table, rows, tiles, got, src, dst)
    want = _expected(memory, offsets, metas, table)
    assert got.tobytes() == want.tobytes()
    assert (got[PARAM_AT:] != 0).any()


def test_a_table_lists_each_landing_once_then_a_tile_per_tile_elements() -> None:
    row = geometry_row(
        Strided(0, "float32", 0, 0, "bfloat16", (2, TILE + 1), (TILE + 1, 1), (1, 2))
    )
    assert list(row[2:4]) == [2, 2 * TILE + 2]
    assert list(row[4:6]) == [2, TILE + 1] and list(row[12:14]) == [TILE + 1, 1]
    assert list(row[20:22]) == [1, 2]
    small = geometry_row(Strided(0, "float32", 0, 0, "bfloat16", (3,), (1,), (2,)))
    table, rows, tiles = batch_table([(row, 1000, 2000), (small, 3000, 4000)])
    assert (rows, tiles) == (2, 4) and table.size == 2 * ROW + 2 * 4
    assert list(table[:2]) == [1000, 2000] and list(table[ROW : ROW + 2]) == [3000, 4000]
    assert table[2 * ROW :].reshape(4, 2).tolist() == [[0, 0], [0, TILE], [0, 2 * TILE], [1, 0]]


def test_a_nan_cast_to_bfloat16_is_the_quiet_nan_the_per_landing_kernel_writes() -> None:
    words = np.array([np.nan, -np.nan, 1.0, 1.00390625, 1.01171875], dtype=np.float32)
    got = convert_like_kernel(words.view(np.uint32), "float32", "bfloat16")
    # ties to even: 1 + 2^-8 rounds down to 1.0, 1 + 3 * 2^-8 up to 1 + 2^-6
    assert got.tolist() == [0x7FC0, 0x7FC0, 0x3F80, 0x3F80, 0x3F82]


# -- launch_all on a fake CUDA runtime -------------------------------------------------------


class _DevArray:
    def __init__(self, values: np.ndarray) -> None:
        self.values = values
        self.data = type("Ptr", (), {"ptr": values.ctypes.data})()


class _Kernel:
    def __init__(self, cuda: _FakeCuda, source: str, name: str) -> None:
        self.cuda, self.key, self.name = cuda, tuple(source.split()), name

    def compile(self) -> None:
        if self.name in self.cuda.broken:
            raise RuntimeError("nvrtc: no")

    def __call__(self, grid: Any, block: Any, args: tuple[Any, ...], stream: Any) -> None:
        self.cuda.launches.append((self.name, self.key))
        src, dst = self.key
        memory = self.cuda.memory
        if self.name == "ww_strided_batch":
            table, rows, tiles = args
            reference_batch(table.values, int(rows), int(tiles), memory, src, dst)
            return
        s, d, geo, ndim, numel = (int(a) if not isinstance(a, _DevArray) else a for a in args)
        g = geo.values
        one = np.concatenate([[s, d, ndim, numel], np.zeros(ROW - 4, dtype=np.int64)])
        for k in range(ndim):
            one[4 + k] = g[k]
            one[4 + kernels.MAX_NDIM + k] = g[ndim + k]
            one[4 + 2 * kernels.MAX_NDIM + k] = g[2 * ndim + k]
        table, rows, tiles = batch_table([(one, s, d)])
        reference_batch(table, rows, tiles, memory, src, dst)


class _Runtime:
    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        assert kind == 1 and stream == 77  # host to device, on the fill stream
        ctypes.memmove(dst, src, n)
        self.cuda.uploads += 1

    def eventCreateWithFlags(self, flags: int) -> int:
        return 5

    def eventRecord(self, event: int, stream: int) -> None:
        assert stream == 77

    def eventQuery(self, event: int) -> int:
        return 0

    def eventDestroy(self, event: int) -> None:
        pass


class _FakeCuda:
    def __init__(self, memory: np.ndarray) -> None:
        self.memory = memory
        self.launches: list[tuple[str, tuple[str, ...]]] = []
        self.uploads = 0
        self.broken: set[str] = set()
        self.runtime = _Runtime(self)

    def Device(self, device: int) -> Any:
        return nullcontext()

    def alloc_pinned_memory(self, n: int) -> bytearray:
        return bytearray(n)


class _FakeCp:
    int64 = np.int64

    def __init__(self, memory: np.ndarray) -> None:
        self.cuda = _FakeCuda(memory)

    def RawKernel(self, source: str, name: str) -> _Kernel:
        return _Kernel(self.cuda, source, name)

    def asarray(self, values: np.ndarray) -> _DevArray:
        return _DevArray(np.array(values))

    def zeros(self, n: int, dtype: Any) -> _DevArray:
        return _DevArray(np.zeros(n, dtype=dtype))

    def empty(self, n: int, dtype: Any) -> _DevArray:
        return _DevArray(np.empty(n, dtype=dtype))


def _two_pairs() -> tuple[list[ParamMeta], LandingTable]:
    """The float32 case's landings plus a bfloat16 norm cast to float32: two dtype pairs."""
    metas, table = _case("float32", "bfloat16")
    extra = ParamMeta("norm32", "bfloat16", (6,))
    at = table.allocs[0].nbytes
    slot = ParamSlot("norm32", 0, at, 24, "float32")
    return [*metas, extra], LandingTable(
        (Alloc(H, at + 64),),
        (*table.params, slot),
        (*table.tensors, TensorLands("norm32", (Land(len(table.params), (6,), 0, (1,), 0, (1,)),))),
    )


def _launch_all(
    monkeypatch: pytest.MonkeyPatch, batch: str, rounds: int = 1, broken: str = ""
) -> tuple[np.ndarray, _FakeCp]:
    monkeypatch.setenv("WEIGHTWIRE_IPC_STRIDED_BATCH", batch)
    monkeypatch.setattr(kernels, "_source", lambda s, d, body=None: f"{s} {d}")
    metas, table = _two_pairs()
    memory, offsets = _sources(metas, np.random.default_rng(3))
    cp = _FakeCp(memory)
    if broken:
        cp.cuda.broken.add(broken)
    copier = StridedCopy(cp, 0, 77)
    prepared = [
        [(copier.prepare(j), PARAM_AT) for j in c.strided] for c in plan_copies(table, metas)
    ]
    for _ in range(rounds):
        jobs = [
            (launch, at, alloc)
            for at, p in zip(offsets, prepared, strict=True)
            for launch, alloc in p
        ]
        copier.launch_all(jobs, "fill stream", deadline=1e18, alive=lambda: None)
    want = _expected(memory.copy(), offsets, metas, table)
    assert memory.tobytes() == want.tobytes()
    copier.close()
    return memory, cp


def test_a_chunks_strided_landings_are_one_launch_per_dtype_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batched, cp = _launch_all(monkeypatch, "1", rounds=3)
    launches = cp.cuda.launches
    assert (
        launches
        == [
            ("ww_strided_batch", ("float32", "bfloat16")),  # 9 landings, the empty one skipped
            ("ww_strided", ("bfloat16", "float32")),  # a lone landing: launched alone
        ]
        * 3
    )
    assert cp.cuda.uploads == 1  # the same table each round: uploaded once, then reused
    alone, cp_alone = _launch_all(monkeypatch, "0")
    assert {name for name, _ in cp_alone.cuda.launches} == {"ww_strided"}
    assert len(cp_alone.cuda.launches) == 10 and cp_alone.cuda.uploads == 0
    assert batched.tobytes() == alone.tobytes()


def test_a_batched_kernel_that_does_not_compile_launches_each_landing_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, cp = _launch_all(monkeypatch, "1", rounds=2, broken="ww_strided_batch")
    assert {name for name, _ in cp.cuda.launches} == {"ww_strided"}
    assert len(cp.cuda.launches) == 20
    said = [r.getMessage() for r in caplog.records if "did not compile" in r.getMessage()]
    assert said == [
        "weightwire_ipc: the batched write-through copy for float32 -> bfloat16 did not "
        "compile (RuntimeError: nvrtc: no); each landing is launched alone"
    ]


def test_the_batch_switch_takes_0_or_1_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTWIRE_IPC_STRIDED_BATCH", "yes")
    with pytest.raises(
        ConfigError, match="WEIGHTWIRE_IPC_STRIDED_BATCH must be '0' or '1', got 'yes'"
    ):
        kernels.batch_enabled()


# -- the CUDA sources themselves, compiled as host C++ -----------------------------------------

_HOST = r"""
#include <string.h>
#define __global__
#define __device__
#define __forceinline__ inline
struct ww_dim { unsigned x; };
static ww_dim blockIdx, threadIdx, blockDim, gridDim;
static unsigned int __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
typedef _Float16 __half;
static float __half2float(__half h) { return (float)h; }
static __half __ushort_as_half(unsigned short x) { __half h; memcpy(&h, &x, 2); return h; }
static __half __float2half_rn(float f) { return (__half)f; }
static unsigned short __half_as_ushort(__half h) { unsigned short u; memcpy(&u, &h, 2); return u; }
"""
_GRID = r"""
extern "C" void run_batch_$K(const long long* table, long long rows, long long tiles, int grid) {
    gridDim.x = grid; blockDim.x = 256;
    for (unsigned b = 0; b < (unsigned)grid; ++b)
        for (unsigned t = 0; t < 256; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            batch_$K(table, rows, tiles);
        }
}
extern "C" void run_one_$K(unsigned long long s, unsigned long long d, const long long* geo,
                           int ndim, long long n, int grid) {
    gridDim.x = grid; blockDim.x = 256;
    for (unsigned b = 0; b < (unsigned)grid; ++b)
        for (unsigned t = 0; t < 256; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            one_$K(s, d, geo, ndim, n);
        }
}
"""


def _host_library(tmp: Any) -> Any:
    """Every pair's per-landing and batched kernel, as ``kernels`` writes them for NVRTC,
    compiled by the host's C++ compiler: CUDA's thread indices become loops (the threads
    share nothing, so running them one by one is what the device computes)."""
    import shutil
    import subprocess
    from string import Template

    if shutil.which("g++") is None:
        pytest.skip("no g++ on this host to compile the kernels' sources")
    parts = [_HOST, kernels._HALF.replace("#include <cuda_fp16.h>", ""), kernels._HEAD]
    for k, (src, dst) in enumerate(PAIRS):
        for body, name in ((kernels._BATCH_BODY, "batch"), (kernels._BODY, "one")):
            text = kernels._source(src, dst, body)
            text = text[text.index('extern "C"') :]  # the helpers once, above
            text = text.replace("ww_strided_batch(", f"{name}_{k}(").replace(
                "ww_strided(", f"{name}_{k}("
            )
            parts.append(text.replace('extern "C" ', "static "))
        parts.append(Template(_GRID).substitute(K=k))
    source, lib = tmp / "kernels.cpp", tmp / "kernels.so"
    source.write_text("\n".join(parts))
    subprocess.run(
        ["g++", "-O1", "-shared", "-fPIC", "-o", str(lib), str(source)], check=True, timeout=120
    )
    return ctypes.CDLL(str(lib))


@pytest.mark.parametrize("batched", [True, False])
def test_the_kernels_cuda_sources_write_what_each_landing_alone_writes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, batched: bool
) -> None:
    monkeypatch.setattr(through_table, "_runs", lambda *a: None)
    lib = _host_library(tmp_path)
    for k, (src, dst) in enumerate(PAIRS):
        metas, table = _case(src, dst)
        memory, offsets = _sources(metas, np.random.default_rng(k))
        want = _expected(memory, offsets, metas, table)
        base = memory.ctypes.data  # the "device" pointers: this array's own memory
        items, singles = [], []
        for at, c in zip(offsets, plan_copies(table, metas), strict=True):
            for j in c.strided:
                s = base + at + j.src_offset * WIRE_DTYPES[j.src_dtype].itemsize
                items.append((geometry_row(j), s, base + PARAM_AT + j.dst))
                singles.append((j, s, base + PARAM_AT + j.dst))
        if batched:
            table_, rows, tiles = batch_table(items)
            grid = min(tiles, 4096)
            getattr(lib, f"run_batch_{k}")(
                table_.ctypes.data_as(ctypes.c_void_p),
                ctypes.c_longlong(rows),
                ctypes.c_longlong(tiles),
                ctypes.c_int(grid),
            )
        else:
            for j, s, d in singles:
                geo = np.array(j.shape + j.src_strides + j.dst_strides or (0,), dtype=np.int64)
                grid = min(max(1, -(-j.numel // 256)), 4096)
                getattr(lib, f"run_one_{k}")(
                    ctypes.c_ulonglong(s),
                    ctypes.c_ulonglong(d),
                    geo.ctypes.data_as(ctypes.c_void_p),
                    ctypes.c_int(len(j.shape)),
                    ctypes.c_longlong(j.numel),
                    ctypes.c_int(grid),
                )
        diff = np.flatnonzero(memory != want)
        assert not diff.size, f"{src} -> {dst}: {diff.size} bytes differ, first {diff[0]}"
