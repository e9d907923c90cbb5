"""``StridedCopy``: write-through copies that are not contiguous runs, on the fill stream.

A landing whose views do not run together (a slice across a fused parameter's columns, a
transposed layout) or whose dtypes differ (a float32 tensor into a bfloat16 parameter) is
one launch of a grid-stride kernel: each thread walks element indices, turns each into a
source and a destination offset through the view's shape and strides, and converts the
element as torch's ``copy_`` does (float16 through ``__float2half_rn``, bfloat16 by
round-to-nearest-even with NaN kept quiet, float64 narrowed through float32 for the two
16-bit types). Same-dtype copies move raw words of the element's size (every wire dtype,
float8 and bool included). One kernel per dtype pair, compiled with NVRTC on first use;
the view's geometry is uploaded once per table (``prepare``) and kept on the device.

A chunk's strided landings of one dtype pair go as ONE launch (``launch_all``): a
Qwen2-0.5B-sized round cast or cut finely has hundreds of landings per chunk, and a launch
costs ~5-10 us of host time each. The launch walks a table (``batch_table``): one row per
landing (its element 0's source and destination pointers, ``ndim``, ``numel``, then shape,
source strides and destination strides, ``MAX_NDIM`` slots each), followed by one
``(row, first element)`` pair per tile of ``TILE`` elements, so a block takes a tile
whatever the landings' sizes. Each thread's index math is the per-landing kernel's;
``reference_batch`` is that math in numpy over the same table, which the CPU tests run
against an independent copy of each landing. The table reaches the device as the gather
kernel's does: from pinned memory on the fill stream, a ring of ``_RING`` tables each
rewritten only after its last upload ran, and a table equal to one still held is launched
again without an upload. It runs with ``WEIGHTWIRE_IPC_STRIDED_BATCH=1``; by default each
landing is launched alone (see ``batch_enabled``).

CUDA through CuPy, imported inside functions (a JAX trainer uses it without torch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from string import Template
from typing import Any

import numpy as np

from weightwire.backends.ipc.slots import CUDA_EVENT_DISABLE_TIMING, record, wait_event_host
from weightwire.backends.ipc.through.table import MAX_NDIM, Strided
from weightwire.shared.checks import env_switch
from weightwire.shared.dtypes import WIRE_DTYPES
from weightwire.shared.errors import TransferError

log = logging.getLogger(__name__)

_THREADS = 256
_MAX_BLOCKS = 4096
ROW = 4 + 3 * MAX_NDIM
"""int64 slots of one landing's row of a batched launch's table (the module docstring)."""
TILE = 1 << 14
"""Elements of one tile: a block's share of a batched launch (64 per thread)."""
_RING = 4
_MEMCPY_HOST_TO_DEVICE = 1
_WORDS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

_HALF = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float ww_load_float16(unsigned short x) {
    return __half2float(__ushort_as_half(x));
}
__device__ __forceinline__ unsigned short ww_store_float16(float f) {
    return __half_as_ushort(__float2half_rn(f));
}
"""
_HEAD = r"""
__device__ __forceinline__ float ww_load_bfloat16(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}
__device__ __forceinline__ float ww_load_float32(float x) { return x; }
__device__ __forceinline__ double ww_load_float64(double x) { return x; }
__device__ __forceinline__ unsigned short ww_store_bfloat16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float ww_store_float32(float f) { return f; }
__device__ __forceinline__ double ww_store_float64(double f) { return f; }
// CuPy compiles with -ftz=true, which flushes subnormals in a plain (float) / (double)
// conversion; these keep them, as torch's copy_ and numpy do
__device__ __forceinline__ float ww_narrow(double x) {
#ifdef __CUDA_ARCH__
    float r;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x));
    return r;
#else
    return (float)x;
#endif
}
__device__ __forceinline__ double ww_widen(float x) {
#ifdef __CUDA_ARCH__
    double r;
    asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(x));
    return r;
#else
    return (double)x;
#endif
}
"""
_RAW = {
    "bfloat16": "unsigned short",
    "float16": "unsigned short",
    "float32": "float",
    "float64": "double",
}

_BODY = Template(
    r"""
extern "C" __global__ void ww_strided(
    unsigned long long src, unsigned long long dst, const long long* geo, int ndim, long long n
) {
    const $ST* s = (const $ST*)src;
    $DT* t = ($DT*)dst;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long rem = i, so = 0, dof = 0;
        for (int d = ndim - 1; d >= 0; --d) {
            long long k = rem % geo[d];
            rem /= geo[d];
            so += k * geo[ndim + d];
            dof += k * geo[2 * ndim + d];
        }
        t[dof] = $EXPR;
    }
}
"""
)


_BATCH_BODY = Template(
    r"""
extern "C" __global__ void ww_strided_batch(const long long* table, long long rows,
                                            long long tiles) {
    const long long* tile_of = table + rows * $ROW;
    for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
        const long long* r = table + tile_of[2 * t] * $ROW;
        const $ST* s = (const $ST*)(unsigned long long)r[0];
        $DT* t_ = ($DT*)(unsigned long long)r[1];
        const int ndim = (int)r[2];
        const long long numel = r[3];
        const long long* geo = r + 4;
        const long long first = tile_of[2 * t + 1];
        const long long end = first + $TILE < numel ? first + $TILE : numel;
        for (long long i = first + threadIdx.x; i < end; i += blockDim.x) {
            long long rem = i, so = 0, dof = 0;
            for (int d = ndim - 1; d >= 0; --d) {
                long long k = rem % geo[d];
                rem /= geo[d];
                so += k * geo[$NDIM + d];
                dof += k * geo[2 * $NDIM + d];
            }
            t_[dof] = $EXPR;
        }
    }
}
"""
)


def _source(src: str, dst: str, body: Template = _BODY) -> str:
    """The kernel's source for one dtype pair (``body``: per landing, or batched)."""
    fixed = {"ROW": ROW, "NDIM": MAX_NDIM, "TILE": TILE}
    if src == dst:
        word = _WORDS[WIRE_DTYPES[src].itemsize]
        return body.substitute(ST=word, DT=word, EXPR="s[so]", **fixed)
    # float64 reaches a 16-bit dtype through float32, as torch converts it
    value = f"ww_load_{src}(s[so])"
    if src == "float64":
        value = f"ww_narrow({value})"
    elif dst == "float64":
        value = f"ww_widen({value})"
    expr = f"ww_store_{dst}({value})"
    half = _HALF if "float16" in (src, dst) else ""  # the header only where it is needed
    return half + _HEAD + body.substitute(ST=_RAW[src], DT=_RAW[dst], EXPR=expr, **fixed)


def batch_enabled() -> bool:
    """``WEIGHTWIRE_IPC_STRIDED_BATCH``: ``1`` launches a chunk's strided landings of one
    dtype pair together, ``0`` (default) one launch per landing. Off by default until the GPU
    lane (``tests/gpu/test_ipc_strided_batch_gpu.py``) and ``bench_strided.py`` have run on a
    GPU: a wrong cast there would be served silently."""
    return env_switch(
        "WEIGHTWIRE_IPC_STRIDED_BATCH", False, "one launch per chunk", "one launch per landing"
    )


def geometry_row(job: Strided) -> np.ndarray:
    """``job``'s row of a batched table, its two pointers left 0 (``batch_table`` sets them)."""
    row = np.zeros(ROW, dtype=np.int64)
    n = len(job.shape)
    row[2], row[3] = n, job.numel
    row[4 : 4 + n] = job.shape
    row[4 + MAX_NDIM : 4 + MAX_NDIM + n] = job.src_strides
    row[4 + 2 * MAX_NDIM : 4 + 2 * MAX_NDIM + n] = job.dst_strides
    return row


def batch_table(items: Sequence[tuple[np.ndarray, int, int]]) -> tuple[np.ndarray, int, int]:
    """The table of one batched launch: per ``(geometry row, source pointer, destination
    pointer)`` (the pointers of the landing's element 0) its row, then the tiles; returns
    the table (int64), its rows and its tiles. Empty landings take no row."""
    kept = [item for item in items if item[0][3] > 0]
    rows = len(kept)
    head_rows = np.stack([g for g, _, _ in kept]) if kept else np.empty((0, ROW), np.int64)
    per = (head_rows[:, 3] + (TILE - 1)) // TILE
    tiles = int(per.sum())
    table = np.empty(rows * ROW + 2 * tiles, dtype=np.int64)
    head = table[: rows * ROW].reshape(rows, ROW)
    head[:] = head_rows
    head[:, 0] = [src for _, src, _ in kept]  # one array op per column, not per landing
    head[:, 1] = [dst for _, _, dst in kept]
    pairs = table[rows * ROW : rows * ROW + 2 * tiles].reshape(tiles, 2)
    owner = np.repeat(np.arange(rows, dtype=np.int64), per)
    pairs[:, 0] = owner
    pairs[:, 1] = (np.arange(tiles, dtype=np.int64) - (np.cumsum(per) - per)[owner]) * TILE
    return table, rows, tiles


def reference_batch(
    table: np.ndarray, rows: int, tiles: int, memory: np.ndarray, src: str, dst: str
) -> None:
    """What one batched launch of ``table`` writes, in numpy: ``memory`` (uint8) stands for
    the device's, a pointer is a byte offset into it. Every tile's elements go through the
    kernel's index math and its conversion (``convert_like_kernel``)."""
    head = table[: rows * ROW].reshape(rows, ROW)
    pairs = table[rows * ROW : rows * ROW + 2 * tiles].reshape(tiles, 2)
    si, di = WIRE_DTYPES[src].itemsize, WIRE_DTYPES[dst].itemsize
    for owner, first in pairs:
        r = head[owner]
        ndim, numel = int(r[2]), int(r[3])
        i = np.arange(first, min(first + TILE, numel), dtype=np.int64)
        rem, so, dof = i.copy(), np.zeros_like(i), np.zeros_like(i)
        for d in range(ndim - 1, -1, -1):
            k = rem % r[4 + d]
            rem //= r[4 + d]
            so += k * r[4 + MAX_NDIM + d]
            dof += k * r[4 + 2 * MAX_NDIM + d]
        at = (int(r[0]) + so * si)[:, None] + np.arange(si)
        words: np.ndarray = memory[at].reshape(-1).view(_word(si))
        out = convert_like_kernel(words, src, dst)
        memory[(int(r[1]) + dof * di)[:, None] + np.arange(di)] = out.view(np.uint8).reshape(-1, di)


def _word(size: int) -> type:
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]


def convert_like_kernel(words: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Elements (raw words of ``src``) converted as the kernels' ``ww_load_*`` /
    ``ww_store_*`` do, as raw words of ``dst``."""
    if src == dst:
        return words
    with np.errstate(over="ignore", invalid="ignore"):  # past a dtype's range: infinity
        return _convert(words, src, dst)


def _convert(words: np.ndarray, src: str, dst: str) -> np.ndarray:
    if src == "bfloat16":
        value: np.ndarray = (words.astype(np.uint32) << np.uint32(16)).view(np.float32)
    elif src == "float16":
        value = words.view(np.float16).astype(np.float32)
    else:
        value = words.view(np.float32 if src == "float32" else np.float64)
    if src == "float64" and dst != "float32":
        value = value.astype(np.float32)  # the kernel's (float): through float32, as torch
    if dst == "bfloat16":
        u = value.astype(np.float32).view(np.uint32)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> 16).astype(
            np.uint16
        )
        return np.where(nan, np.uint16(0x7FC0), rounded)
    if dst == "float16":
        return value.astype(np.float32).astype(np.float16).view(np.uint16)
    return value.astype(np.float32 if dst == "float32" else np.float64).view(
        _word(WIRE_DTYPES[dst].itemsize)
    )


@dataclass(frozen=True)
class Launch:
    """One prepared strided copy: its kernel, geometry on the device and element count."""

    kernel: Any
    geo: Any
    ndim: int
    numel: int
    src_offset_bytes: int
    alloc: int
    dst: int
    key: tuple[str, str] = ("", "")
    """Its dtype pair: the batched kernel it goes through."""
    row: Any = None
    """Its geometry row of a batched table (``geometry_row``)."""


class StridedCopy:
    """Compiles and launches ``Strided`` copies on one stream (see the module docstring)."""

    def __init__(self, cp: Any, device: int, stream_ptr: int = 0) -> None:
        self._cp, self._device = cp, int(device)
        self._kernels: dict[tuple[str, str], Any] = {}
        self._batch_kernels: dict[tuple[str, str], Any] = {}
        self._batch = batch_enabled()
        self._uploads = _Uploads(cp, int(device), int(stream_ptr))

    def prepare(self, job: Strided) -> Launch:
        """Compile the job's kernel (once per dtype pair) and upload its geometry; raises
        ``TransferError`` naming the pair where NVRTC cannot build it."""
        import numpy as np

        cp = self._cp
        key = (job.src_dtype, job.dst_dtype)
        kernel = self._kernels.get(key)
        with cp.cuda.Device(self._device):
            if kernel is None:
                try:
                    kernel = cp.RawKernel(_source(*key), "ww_strided")
                    kernel.compile()
                except Exception as exc:
                    raise TransferError(
                        f"the write-through copy kernel for {key[0]} -> {key[1]} did not "
                        f"compile ({type(exc).__name__}: {str(exc)[:200]})"
                    ) from exc
                self._kernels[key] = kernel
            geo = np.array(job.shape + job.src_strides + job.dst_strides, dtype=np.int64)
            device_geo = cp.asarray(geo) if geo.size else cp.zeros(1, dtype=cp.int64)
        item = WIRE_DTYPES[job.src_dtype].itemsize
        return Launch(
            kernel,
            device_geo,
            len(job.shape),
            job.numel,
            job.src_offset * item,
            job.alloc,
            job.dst,
            key,
            geometry_row(job),
        )

    def launch_all(
        self,
        jobs: Sequence[tuple[Launch, int, int]],
        stream: Any,
        *,
        deadline: float,
        alive: Callable[[], None],
    ) -> None:
        """Enqueue every ``(job, tensor pointer, allocation pointer)``: one launch per dtype
        pair (a lone landing, or batching off: its own launch, as ``launch``)."""
        self.launch_staged(self.stage_all(jobs, deadline=deadline, alive=alive), stream)

    def stage_all(
        self,
        jobs: Sequence[tuple[Launch, int, int]],
        *,
        deadline: float,
        alive: Callable[[], None],
    ) -> StagedLaunches:
        """``launch_all``'s launches with their arguments built and their batched tables
        uploaded (only this copier's memory is written), enqueued by ``launch_staged``."""
        groups: dict[tuple[str, str], list[tuple[Launch, int, int]]] = {}
        for item in jobs:
            if item[0].numel:
                groups.setdefault(item[0].key, []).append(item)
        staged = StagedLaunches([], [])
        try:
            for key, group in groups.items():
                kernel = self._batch_kernel(key) if self._batch and len(group) > 1 else None
                put = None
                if kernel is not None:
                    table, rows, tiles = batch_table(
                        [(j.row, src + j.src_offset_bytes, dst + j.dst) for j, src, dst in group]
                    )
                    put = self._uploads.put(table, deadline=deadline, alive=alive)
                if put is None:  # one launch per landing (or every table awaits its launch)
                    staged.calls.extend(_call(job, src, dst) for job, src, dst in group)
                    continue
                device, slot = put
                args = (device, np.int64(rows), np.int64(tiles))
                staged.calls.append((kernel, (min(tiles, _MAX_BLOCKS),), args))
                staged.slots.append(slot)
        except BaseException:
            self.discard(staged)  # the groups staged before: their slots would stall the ring
            raise
        return staged

    def launch_staged(self, staged: StagedLaunches, stream: Any) -> None:
        """Enqueue ``staged`` (from ``stage_all``) on ``stream``; its slots are released
        whatever happens."""
        try:
            for kernel, grid, args in staged.calls:
                kernel(grid, (_THREADS,), args, stream=stream)
        finally:
            self.discard(staged)

    def discard(self, staged: StagedLaunches) -> None:
        """``staged`` will not be launched (or just was): its tables' slots may be rewritten."""
        slots, staged.slots = staged.slots, []
        self._uploads.release(slots)

    def _batch_kernel(self, key: tuple[str, str]) -> Any:
        """The batched kernel of ``key``, compiled once; None (each landing alone, said
        once) where it does not compile though the per-landing one did."""
        if key in self._batch_kernels:
            return self._batch_kernels[key]
        kernel = None
        try:
            with self._cp.cuda.Device(self._device):
                kernel = self._cp.RawKernel(_source(*key, _BATCH_BODY), "ww_strided_batch")
                kernel.compile()
        except Exception as exc:  # correct without it: one launch per landing
            log.warning(
                "weightwire_ipc: the batched write-through copy for %s -> %s did not compile "
                "(%s: %s); each landing is launched alone",
                *key,
                type(exc).__name__,
                str(exc)[:200],
            )
            kernel = None
        self._batch_kernels[key] = kernel
        return kernel

    def close(self) -> None:
        """Free the batched tables (after the stream settled: a launch may still read them)."""
        self._uploads.close()

    def launch(self, job: Launch, src: int, dst: int, stream: Any) -> None:
        """Enqueue ``job`` reading the tensor at ``src`` into the allocation at ``dst``."""
        if not job.numel:
            return
        kernel, grid, args = _call(job, src, dst)
        kernel(grid, (_THREADS,), args, stream=stream)


@dataclass
class StagedLaunches:
    """Kernel launches ready to enqueue: ``(kernel, grid, arguments)`` each, and the ring
    slots of the batched tables they read (held until they were enqueued)."""

    calls: list[tuple[Any, tuple[int], tuple[Any, ...]]]
    slots: list[int]


def _call(job: Launch, src: int, dst: int) -> tuple[Any, tuple[int], tuple[Any, ...]]:
    """``job``'s own launch reading the tensor at ``src`` into the allocation at ``dst``."""
    blocks = min(-(-job.numel // _THREADS), _MAX_BLOCKS)
    args = (
        np.uint64(src + job.src_offset_bytes),
        np.uint64(dst + job.dst),
        job.geo,
        np.int32(job.ndim),
        np.int64(job.numel),
    )
    return job.kernel, (blocks,), args


class _Uploads:
    """A ring of batched tables on the device, each uploaded from pinned memory on the fill
    stream (the module docstring); ``put`` returns the device table to launch on and its
    slot, which the caller ``release``-s once the launch was enqueued (or dropped): a slot
    with a launch still to come is not rewritten."""

    def __init__(self, cp: Any, device: int, stream_ptr: int) -> None:
        self._cp, self._device, self._stream = cp, device, stream_ptr
        self._slots: list[tuple[Any, Any, int]] = []  # pinned host, device table, event
        self._held: list[np.ndarray | None] = [None] * _RING
        self._staged = [0] * _RING
        self._capacity = 0  # int64s per table
        self._next = 0

    def put(
        self, table: np.ndarray, *, deadline: float, alive: Callable[[], None]
    ) -> tuple[Any, int] | None:
        """``(device table, slot)``; None where the slot to write (or, to grow, any slot)
        still waits for a launch."""
        for k, held in enumerate(self._held):
            # every later upload into slot k is queued behind the launch that reads it now
            if held is not None and held.size == table.size and np.array_equal(held, table):
                self._staged[k] += 1
                return self._slots[k][1], k
        k = self._next
        if self._staged[k] or (table.size > self._capacity and any(self._staged)):
            return None
        if table.size > self._capacity:
            self._grow(table.size, deadline=deadline, alive=alive)
        self._next = (k + 1) % _RING
        host, device, event = self._slots[k]
        self._held[k] = None
        wait_event_host(
            self._cp,
            event,
            deadline=deadline,
            what="the batched copy table's previous upload",
            alive=alive,
        )
        staged = np.frombuffer(host, dtype=np.int64, count=table.size)
        staged[:] = table
        self._cp.cuda.runtime.memcpyAsync(
            device.data.ptr, staged.ctypes.data, table.nbytes, _MEMCPY_HOST_TO_DEVICE, self._stream
        )
        record(self._cp, event, self._stream)  # behind the upload: the pinned copy is free then
        self._held[k] = table
        self._staged[k] += 1
        return device, k

    def release(self, slots: Sequence[int]) -> None:
        for k in slots:
            self._staged[k] -= 1

    def _grow(self, size: int, *, deadline: float, alive: Callable[[], None]) -> None:
        if self._slots:
            # one event behind every queued upload and launch that reads an old table (all
            # on this stream) ran before the tables go
            last = self._slots[0][2]
            record(self._cp, last, self._stream)
            wait_event_host(
                self._cp,
                last,
                deadline=deadline,
                what="the batched copy tables' last launch",
                alive=alive,
            )
        self.close()
        capacity = max(1024, 1 << (size - 1).bit_length())
        cp = self._cp
        with cp.cuda.Device(self._device):
            for _ in range(_RING):
                host = cp.cuda.alloc_pinned_memory(capacity * 8)
                device = cp.empty(capacity, dtype=cp.int64)
                event = cp.cuda.runtime.eventCreateWithFlags(CUDA_EVENT_DISABLE_TIMING)
                self._slots.append((host, device, event))
        self._capacity = capacity

    def close(self) -> None:
        slots, self._slots, self._capacity = self._slots, [], 0
        self._held = [None] * _RING
        self._staged = [0] * _RING
        for _, _, event in slots:
            try:
                self._cp.cuda.runtime.eventDestroy(event)
            except Exception:  # teardown: an event that will not go is the driver's to reclaim
                log.debug("weightwire_ipc: destroying a batched-table event failed", exc_info=True)
