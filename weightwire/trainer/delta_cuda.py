"""Fused delta extraction on a CUDA device, shared by the JAX and the torch trainer.

One pass over the new weights and the base per round, one launch per batch of layer groups
(``DeltaTracker.group_bytes``; ``delta_cuda_source``): compare bit patterns, count per
tensor, compact each tensor's changed elements (``int32`` flat indices and values, in
increasing index order) into a scratch region sized by the tensor's patch limit, and write
the changed elements into the base. The counts come back with one host sync per launch; the
caller can start the next launch before waiting on this one (``DeltaTracker.build`` does),
so the device does not idle on the sync. Then ``pack`` copies the tensors that go as patches
out of the scratch into tight buffers the caller allocated (one launch), and the scratch is
released.

Framework-neutral: tensors reach it as raw device pointers (``Operand``), device memory
comes from the caller's allocator (stream-ordered on the stream it launches on: the torch
kernel's session workspace, ``torch_side.sender.delta.Workspace``, CuPy's pool on the JAX
kernel's own stream),
and every launch goes on the caller's stream. CuPy is imported on first use.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightwire.backends.device import StreamRef
from weightwire.shared.errors import ConfigError
from weightwire.trainer.delta_cuda_source import SOURCE


@dataclass(frozen=True)
class Tiling:
    """How ``ww_delta`` cuts the work: ``threads`` per block, ``vec`` 16-byte vectors of each
    operand per thread (a tile: threads x vec x 16 bytes), ``min_blocks`` per SM asked of
    the compiler (``__launch_bounds__``; it caps the registers)."""

    threads: int
    vec: int
    min_blocks: int = 1

    def __post_init__(self) -> None:
        if self.vec not in (1, 2, 4, 8, 16) or self.threads not in (128, 256, 512, 1024):
            raise ConfigError(
                f"need vec in 1, 2, 4, 8, 16 and threads in 128, 256, 512, 1024, got {self}"
            )

    def tiles(self, numel: Any, itemsize: Any) -> Any:
        """Tiles of a tensor of ``numel`` elements of ``itemsize`` bytes (ints, or numpy
        arrays of them: a column per launch)."""
        return -(-numel // (self.threads * self.vec * 16 // itemsize))


TILING = Tiling(256, 4, 6)
"""The tiling ``fused`` compiles by default. Occupancy is what counts: the kernel's latency
chain per tile (ticket, table, loads, look-back) is hidden by resident blocks, and 6 blocks
of 256 threads per SM (registers capped to fit) ran an 8B-shaped round at 11.5 ms on an H200
against 40 ms for the compiler's own choice of registers (``bench_delta.py --tilings``)."""
_PACK_CHUNK = 65536
_PACK_THREADS = 256
_MAX_GRID_Y = 65535
_ALIGN = 16
_ENTRY = np.dtype(
    [
        ("fresh", "<u8"),
        ("base", "<u8"),
        ("index", "<u8"),
        ("values", "<u8"),
        ("numel", "<i8"),
        ("capacity", "<i8"),
        ("first_tile", "<i8"),
        ("tiles", "<i8"),
        ("itemsize", "<i4"),
        ("aligned", "<i4"),
    ]
)
_COPY = np.dtype([("src", "<u8"), ("dst", "<u8"), ("bytes", "<u8")])

Alloc = Callable[[int], tuple[int, Any]]
"""``alloc(nbytes) -> (device pointer, owner)``: device memory, stream-ordered on the launch
stream, alive while ``owner`` is."""


def _up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


def available() -> bool:
    """CuPy imports and sees a CUDA device."""
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return False


class ScratchRing:
    """Launch scratch kept across rounds for one stream: each buffer the size of the largest
    launch so far (a launch's scratch is sized by its tensors' patch limits, the same every
    round of a session), taken by a launch and given back once its pack is enqueued. On one
    stream a buffer given back is reused in stream order, with no event; ``ahead + 1``
    buffers serve a round. Per-round allocations of the scratch's size from a shared pool
    miss on a nearly full card and free the pool to retry, a device sync mid-round (#49)."""

    def __init__(self, alloc: Alloc) -> None:
        self._alloc = alloc
        self.nbytes = 0
        self._idle: list[tuple[int, Any]] = []
        self._sizes: dict[int, int] = {}
        """Pointer -> size of each buffer taken and not given back."""
        self.allocations = 0
        """Buffers allocated: the first round's only, in a steady session."""

    def take(self, nbytes: int) -> tuple[int, Any]:
        """``Alloc``: an idle buffer of at least ``nbytes``, or a new one of the largest size."""
        if nbytes > self.nbytes:
            self.nbytes = nbytes
            self._idle.clear()  # outgrown: back to the pool they came from
        if self._idle:
            got = self._idle.pop()
        else:
            self.allocations += 1
            got = self._alloc(self.nbytes)
        self._sizes[got[0]] = self.nbytes
        return got

    def give_back(self, ptr: int, owner: Any) -> None:
        """A buffer ``take`` gave, its launch packed on the ring's stream."""
        if self._sizes.pop(ptr, 0) >= self.nbytes:
            self._idle.append((ptr, owner))


@dataclass(slots=True)
class Operand:
    """One tensor of a group as device memory: ``new`` is read, ``base`` gets new's bytes."""

    new: int
    base: int
    numel: int
    itemsize: int
    limit: int
    """Output slots: the most changed elements the tensor may have and go as a patch."""
    key: str
    """Which values buffer its patch goes to (one per dtype)."""

    def tiles(self, tiling: Tiling = TILING) -> int:
        return int(tiling.tiles(self.numel, self.itemsize))


@dataclass(frozen=True)
class Layout:
    """Where each patch of a group goes in its tight buffers (byte offsets, 16-aligned;
    ``-1``: the tensor is no patch: nothing changed, or more than its limit)."""

    index_bytes: int
    values_bytes: dict[str, int]
    index_at: list[int]
    values_at: list[int]


def layout(operands: Sequence[Operand], counts: Sequence[int]) -> Layout:
    """Tight buffers for the patches (``0 < count <= limit``) of one group."""
    index_bytes = 0
    values_bytes: dict[str, int] = {}
    index_at: list[int] = []
    values_at: list[int] = []
    for op, count in zip(operands, counts, strict=True):
        if not 0 < count <= op.limit:
            index_at.append(-1)
            values_at.append(-1)
            continue
        index_at.append(index_bytes)
        index_bytes += _up(4 * count)
        at = values_bytes.get(op.key, 0)
        values_at.append(at)
        values_bytes[op.key] = at + _up(op.itemsize * count)
    return Layout(index_bytes, values_bytes, index_at, values_at)


@dataclass
class Pending:
    """One group's launch: its scratch, and where its counts land on the host."""

    operands: list[Operand]
    stream: int
    scratch: Any
    scratch_ptr: int
    outputs: list[tuple[int, int]]
    """Per operand: scratch byte offsets of its index and values regions."""
    copies_at: int
    host: Any
    counts_view: np.ndarray
    event: Any
    keep: Any
    """The caller's arrays, alive until the group's work is done."""
    scratch_bytes: int = 0


_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming


class FusedDelta:
    """The compiled kernels on one CUDA device (compiled on first use)."""

    def __init__(self, device: int, tiling: Tiling = TILING) -> None:
        import cupy

        options = (
            "-std=c++17", f"-DWW_VEC={tiling.vec}", f"-DWW_THREADS={tiling.threads}",
            f"-DWW_MIN_BLOCKS={tiling.min_blocks}",
        )  # fmt: skip
        with cupy.cuda.Device(int(device)):
            module = cupy.RawModule(code=SOURCE, options=options)
            kernels = module.get_function("ww_delta"), module.get_function("ww_pack")
        self._setup(cupy, int(device), tiling, *kernels)

    def _setup(self, cupy: Any, device: int, tiling: Tiling, delta: Any, pack: Any) -> None:
        """Everything but the compilation (a CPU test hands in an emulation of CuPy)."""
        self._cp = cupy
        self.device = device
        self.tiling = tiling
        self._delta = delta
        self._pack = pack
        self._events: list[int] = []
        """Idle CUDA events (a group's counts are read after one), reused."""
        self._hosts: list[Any] = []
        """Idle pinned buffers for the counts, reused."""
        self.waited = 0.0
        """Seconds the host spent waiting for counts (the benchmark's host-time split)."""
        self.scratch_live = 0
        self.scratch_peak = 0
        """Scratch bytes of the launches not yet packed, and their most at once."""
        self.timing = False
        """Record a timed event pair around every launch and pack (``device_seconds``)."""
        self._spans: list[tuple[int, int]] = []

    def launch(self, operands: Sequence[Operand], stream: int, alloc: Alloc, keep: Any) -> Pending:
        """Enqueue the group on ``stream`` (a raw CUDA stream pointer); nothing waits."""
        cp = self._cp
        ops = list(operands)
        n = len(ops)
        # Column by column in numpy: a launch covers many tensors (several layer groups), and
        # per-row Python would cost the host more than the device spends on them.
        table = np.empty(n, _ENTRY)
        fresh = np.fromiter((op.new for op in ops), np.uint64, n)
        base = np.fromiter((op.base for op in ops), np.uint64, n)
        numel = np.fromiter((op.numel for op in ops), np.int64, n)
        itemsize = np.fromiter((op.itemsize for op in ops), np.int64, n)
        limit = np.fromiter((op.limit for op in ops), np.int64, n)
        tiles = self.tiling.tiles(numel, itemsize)
        ends = np.cumsum(tiles)
        total = int(ends[-1]) if n else 0
        table_bytes = _up(max(1, n) * _ENTRY.itemsize)
        zeroed = _up(16 + 8 * n) + 8 * total  # ticket, counts, tile status words
        copies_at = table_bytes + _up(zeroed)
        start = copies_at + _up(2 * n * _COPY.itemsize)
        index_size = (4 * limit + _ALIGN - 1) // _ALIGN * _ALIGN
        values_size = (itemsize * limit + _ALIGN - 1) // _ALIGN * _ALIGN
        region_ends = start + np.cumsum(index_size + values_size)
        index_at = region_ends - index_size - values_size
        values_at = region_ends - values_size
        scratch_bytes = int(region_ends[-1]) if n else start
        scratch_ptr, scratch = alloc(scratch_bytes)
        self.scratch_live += scratch_bytes
        self.scratch_peak = max(self.scratch_peak, self.scratch_live)
        table["fresh"] = fresh
        table["base"] = base
        table["index"] = index_at.astype(np.uint64) + np.uint64(scratch_ptr)
        table["values"] = values_at.astype(np.uint64) + np.uint64(scratch_ptr)
        table["numel"] = numel
        table["capacity"] = limit
        table["first_tile"] = ends - tiles
        table["tiles"] = tiles
        table["itemsize"] = itemsize
        table["aligned"] = ((fresh | base) % np.uint64(_ALIGN)) == 0
        host = self._pinned(n)
        counts_view = np.frombuffer(host, np.uint64, n)
        runtime = cp.cuda.runtime
        with cp.cuda.Device(self.device):
            ticket = scratch_ptr + table_bytes
            counts = ticket + 16
            status = ticket + _up(16 + 8 * n)
            span = self._span_start(stream)
            runtime.memsetAsync(ticket, 0, zeroed, stream)
            if n:
                runtime.memcpyAsync(
                    scratch_ptr, table.ctypes.data, table.nbytes, runtime.memcpyHostToDevice, stream
                )
            if total:
                self._delta(
                    (total,),
                    (self.tiling.threads,),
                    (np.uint64(scratch_ptr), np.int32(n), np.uint64(ticket), np.uint64(counts),
                     np.uint64(status)),
                    stream=StreamRef(stream),
                )  # fmt: skip
            if n:
                runtime.memcpyAsync(host.ptr, counts, 8 * n, runtime.memcpyDeviceToHost, stream)
            event = self._event()
            runtime.eventRecord(event, stream)
            self._span_end(span, stream)
        outputs = list(zip(index_at.tolist(), values_at.tolist(), strict=True))
        return Pending(
            ops, stream, scratch, scratch_ptr, outputs, copies_at, host, counts_view, event, keep,
            scratch_bytes,
        )  # fmt: skip

    def counts(self, pending: Pending) -> list[int]:
        """The group's changed-element counts (waits for its launch: the host sync)."""
        t0 = time.perf_counter()
        self._cp.cuda.runtime.eventSynchronize(pending.event)
        self.waited += time.perf_counter() - t0
        self._events.append(pending.event)
        pending.event = None
        got = pending.counts_view.tolist()
        # The counts are read: the pinned buffer serves a later launch.
        self._hosts.append(pending.host)
        pending.host = None
        return got

    def pack(
        self, pending: Pending, plan: Layout, counts: Sequence[int], index: int,
        values: dict[str, int],
    ) -> None:  # fmt: skip
        """Enqueue the copy of every patch into the tight buffers at ``index`` and
        ``values[key]`` (pointers, laid out by ``plan``), then release the scratch."""
        cp = self._cp
        copies = []
        for i, (op, count) in enumerate(zip(pending.operands, counts, strict=True)):
            if plan.index_at[i] < 0:
                continue
            src_index, src_values = pending.outputs[i]
            copies.append((pending.scratch_ptr + src_index, index + plan.index_at[i], 4 * count))
            copies.append(
                (pending.scratch_ptr + src_values, values[op.key] + plan.values_at[i],
                 op.itemsize * count)
            )  # fmt: skip
        if copies:
            table = np.array(copies, _COPY)
            runtime = cp.cuda.runtime
            longest = max(c[2] for c in copies)
            grid = (max(1, math.ceil(longest / _PACK_CHUNK)), min(len(copies), _MAX_GRID_Y))
            with cp.cuda.Device(self.device):
                dst = pending.scratch_ptr + pending.copies_at
                span = self._span_start(pending.stream)
                runtime.memcpyAsync(
                    dst, table.ctypes.data, table.nbytes, runtime.memcpyHostToDevice,
                    pending.stream,
                )  # fmt: skip
                self._pack(
                    grid,
                    (_PACK_THREADS,),
                    (np.uint64(dst), np.int32(len(copies))),
                    stream=StreamRef(pending.stream),
                )
                self._span_end(span, pending.stream)
        # Stream-ordered memory: a later allocation on this stream reuses it only after
        # the copy above ran.
        self.scratch_live -= pending.scratch_bytes
        pending.scratch = None
        pending.keep = None

    def _pinned(self, n: int) -> Any:
        """Pinned host memory for ``n`` counts: an idle buffer large enough, or a new one
        (a round's launches reuse the same few)."""
        for i, host in enumerate(self._hosts):
            if memoryview(host).nbytes >= 8 * n:
                return self._hosts.pop(i)
        return self._cp.cuda.alloc_pinned_memory(max(64, 8 * n))

    def _span_start(self, stream: int) -> int | None:
        if not self.timing:
            return None
        event = int(self._cp.cuda.runtime.eventCreate())
        self._cp.cuda.runtime.eventRecord(event, stream)
        return event

    def _span_end(self, start: int | None, stream: int) -> None:
        if start is not None:
            end = int(self._cp.cuda.runtime.eventCreate())
            self._cp.cuda.runtime.eventRecord(end, stream)
            self._spans.append((start, end))

    def device_seconds(self) -> float:
        """The device time of the launches and packs timed since the last call (waits for
        them): what a round costs the device with no host in the way."""
        runtime = self._cp.cuda.runtime
        total = 0.0
        with self._cp.cuda.Device(self.device):
            for start, end in self._spans:
                runtime.eventSynchronize(end)
                total += runtime.eventElapsedTime(start, end) / 1e3
                runtime.eventDestroy(start)
                runtime.eventDestroy(end)
        self._spans.clear()
        return total

    def _event(self) -> int:
        if self._events:
            return self._events.pop()
        return int(self._cp.cuda.runtime.eventCreateWithFlags(_EVENT_DISABLE_TIMING))


_COMPILED: dict[tuple[int, Tiling], FusedDelta] = {}


def fused(device: int, tiling: Tiling | None = None) -> FusedDelta:
    """The kernels for ``device`` (compiled once per process and tiling; ``None``: the
    module's ``TILING``)."""
    key = (device, tiling or TILING)
    got = _COMPILED.get(key)
    if got is None:
        got = _COMPILED[key] = FusedDelta(*key)
    return got
