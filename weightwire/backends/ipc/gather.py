"""``GatherCopy``: a chunk's tensor copies as one kernel launch plus a memcpy per huge tensor.

Part of ``weightwire_ipc``.

A packed chunk is its tensors' bytes back to back, so filling it is one device copy per
tensor. On an H200 each ``cudaMemcpyAsync`` costs ~6 us of host time, and the GPU runs
small copies no faster than the host issues them: a Qwen2-0.5B chunk (290 tensors, 0.99
GB) took 1.95 ms of host and 1.96 ms of device time where one copy of the same bytes
takes 0.47 ms. Here every tensor under ``SMALL_BYTES`` is cut into ``TILE_BYTES`` tiles,
one row each (source, destination, bytes) of a table that one grid-stride kernel walks,
16 bytes per thread and step where all three are 16-byte aligned (byte by byte where
the packed framing left a tensor unaligned); larger tensors keep their own
``cudaMemcpyAsync``. ``benchmarks/bench_gather.py`` on one H200: 0.5B chunk 0.38 ms host,
0.73 ms device (0.65 of the one-memcpy ceiling); Llama-3-8B 1.79 ms host, 7.98 ms device
(0.96 of the ceiling; per-tensor memcpys: 2.05 / 8.45 ms).

The table reaches the device by an asynchronous copy from pinned host memory on the
fill stream, so it is ordered before the kernel without a host wait. A pinned table is
written again only after the event recorded behind its last use completed (a ring of
``_RING`` tables, each wait bounded by the caller's deadline). A device table is kept
for as long as its ring slot is not rewritten: a chunk with the same sources,
destinations and sizes as one of them (every round of a torch trainer whose parameters
stay in place, into the same worker buffer) launches the kernel on it with no table
built and no upload. Written with CuPy's
``RawKernel`` (NVRTC) because neither CuPy nor the CUDA runtime it wraps has a batched
device-to-device copy that takes arbitrary (unaligned, packed) offsets (CUDA 12.8's
``cudaMemcpyBatchAsync`` is not exposed by CuPy); where the kernel cannot be compiled the
copies fall back to one ``cudaMemcpyAsync`` each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightwire.backends.device import DeviceBytes, StreamRef
from weightwire.backends.ipc.slots import (
    CUDA_EVENT_DISABLE_TIMING,
    MEMCPY_DEVICE_TO_DEVICE,
    record,
    wait_event_host,
)
from weightwire.shared.checks import env_switch

logger = logging.getLogger(__name__)

SMALL_BYTES = 64 << 20
"""Tensors below this go through the gather kernel; larger ones keep their own memcpy
(the copy engine already runs those at the device's bandwidth)."""
TILE_BYTES = 64 << 10
"""A kernel tensor is cut into tiles of this size, one table row each, so one launch
spreads a chunk's bytes evenly over the GPU whatever the tensor sizes."""
MIN_BATCH = 8
"""Fewer small tensors than this are cheaper as plain memcpys than as a table + launch."""
_THREADS = 256
_MAX_BLOCKS = 4096  # blocks stride over the rows: enough to fill an H200 several times over
_RING = 4  # tables in flight, and kept for reuse: a round of up to this many chunks reuses all
_MEMCPY_HOST_TO_DEVICE = 1

_SOURCE = r"""
extern "C" __global__ void weightwire_gather(const unsigned long long* table, long long rows) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const unsigned long long src = table[3 * row], dst = table[3 * row + 1];
        const unsigned long long n = table[3 * row + 2];
        if (((src | dst | n) & 15ULL) == 0) {
            const uint4* s = (const uint4*)src;
            uint4* d = (uint4*)dst;
            for (unsigned long long k = threadIdx.x; k < (n >> 4); k += blockDim.x) d[k] = s[k];
        } else {
            const unsigned char* s = (const unsigned char*)src;
            unsigned char* d = (unsigned char*)dst;
            for (unsigned long long k = threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
        }
    }
}
"""


def gather_enabled() -> bool:
    """``WEIGHTWIRE_IPC_GATHER``: ``1`` (default) batches small tensors into the gather
    kernel, ``0`` copies every tensor with its own memcpy (for comparisons)."""
    return env_switch(
        "WEIGHTWIRE_IPC_GATHER", True, "small tensors through the gather kernel", "a memcpy each"
    )


@dataclass(frozen=True)
class _Table:
    """One ring slot's copy table: pinned host rows, their device copy, the upload's event."""

    host: Any
    device: Any
    event: int


@dataclass(frozen=True)
class _Held:
    """The copies a ring slot's device table describes (their rows' bytes: one compare),
    and its row count."""

    copies: bytes
    rows: int


def _copies(srcs: np.ndarray, dsts: np.ndarray, sizes: np.ndarray) -> bytes:
    return srcs.tobytes() + dsts.tobytes() + sizes.tobytes()


@dataclass
class StagedRows:
    """Copies planned by ``GatherCopy.stage`` and not yet enqueued: their own memcpys
    (``(dst, src, bytes)``) and the gather table the kernel walks, already on the device
    (``table``, ``rows``, its ring ``slot``) or, where every ring slot still waited for a
    launch, its rows (``later``: uploaded at ``launch``)."""

    memcpys: list[tuple[int, int, int]]
    table: Any = None
    rows: int = 0
    slot: int = -1
    later: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


class GatherCopy:
    """Copies ``regions`` back to back into ``dst`` on one stream (see the module docstring).

    The caller keeps the source tensors alive and the destination writable until the
    stream passed that point (the pull pipeline holds a chunk's regions until its fill
    stream settled); ``close`` only after the stream settled.

    ``stage`` does everything but the writes (the plan, the table's build and upload, which
    touch only this copier's own memory) and ``launch`` enqueues them: a written-through
    round stages its first chunk while its start is out and launches once it answered. A
    staged table's ring slot is not rewritten until it was launched (or ``discard``-ed)."""

    def __init__(self, cp: Any, device: int, stream_ptr: int, *, ring: int = _RING) -> None:
        self._cp, self._device, self._stream = cp, int(device), StreamRef(int(stream_ptr))
        self._ring = int(ring)
        self._kernel: Any = None
        self._broken = not gather_enabled()
        self._tables: list[_Table] = []  # one per ring slot
        self._capacity = 0  # rows per table
        self._next = 0
        self._held: list[_Held | None] = [None] * self._ring
        """Per ring slot: the copies its device table holds."""
        self._staged = [0] * self._ring
        """Per ring slot: staged launches that will read its table (not to be rewritten)."""

    def copy(
        self,
        dst: int,
        regions: Sequence[DeviceBytes],
        *,
        deadline: float,
        alive: Callable[[], None],
    ) -> None:
        """Enqueue the copies of ``regions`` on the stream.

        They land at ``dst``, ``dst + regions[0].nbytes``, ... in order.
        """
        sizes = np.fromiter((r.nbytes for r in regions), dtype=np.int64, count=len(regions))
        srcs = np.fromiter((r.ptr for r in regions), dtype=np.uint64, count=len(regions))
        offsets = (np.cumsum(sizes) - sizes).astype(np.uint64)
        self.copy_rows(srcs, np.uint64(dst) + offsets, sizes, deadline=deadline, alive=alive)

    def copy_rows(
        self,
        all_srcs: Sequence[int] | np.ndarray,
        all_dsts: Sequence[int] | np.ndarray,
        all_sizes: Sequence[int] | np.ndarray,
        *,
        deadline: float,
        alive: Callable[[], None],
    ) -> None:
        """Enqueue ``all_sizes[i]`` bytes from ``all_srcs[i]`` to ``all_dsts[i]``, each i."""
        staged = self.stage(all_srcs, all_dsts, all_sizes, deadline=deadline, alive=alive)
        self.launch(staged, deadline=deadline, alive=alive)

    def stage(
        self,
        all_srcs: Sequence[int] | np.ndarray,
        all_dsts: Sequence[int] | np.ndarray,
        all_sizes: Sequence[int] | np.ndarray,
        *,
        deadline: float,
        alive: Callable[[], None],
    ) -> StagedRows:
        """The copies of ``copy_rows``, planned (and their table uploaded), not enqueued."""
        srcs = np.asarray(all_srcs, dtype=np.uint64)
        dsts = np.asarray(all_dsts, dtype=np.uint64)
        sizes = np.asarray(all_sizes, dtype=np.int64)
        some = sizes > 0
        big = some if self._broken else some & (sizes >= SMALL_BYTES)
        memcpys = list(
            zip(dsts[big].tolist(), srcs[big].tolist(), sizes[big].tolist(), strict=True)
        )
        small = some & ~big
        if not small.any():
            return StagedRows(memcpys)
        srcs, dsts, sizes = srcs[small], dsts[small], sizes[small]
        if len(sizes) < MIN_BATCH or not self._ready():
            memcpys += zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True)
            return StagedRows(memcpys)
        return self._stage_table(memcpys, srcs, dsts, sizes, deadline=deadline, alive=alive)

    def launch(self, staged: StagedRows, *, deadline: float, alive: Callable[[], None]) -> None:
        """Enqueue ``staged`` (from ``stage``) on the stream: its memcpys, then the kernel;
        its ring slot is released whatever happens (a slot held for good stalls the ring)."""
        try:
            self._launch_staged(staged, deadline=deadline, alive=alive)
        finally:
            self.discard(staged)

    def _launch_staged(
        self, staged: StagedRows, *, deadline: float, alive: Callable[[], None]
    ) -> None:
        copy, stream = self._cp.cuda.runtime.memcpyAsync, self._stream.ptr
        for d, s, n in staged.memcpys:
            copy(d, s, n, MEMCPY_DEVICE_TO_DEVICE, stream)
        if staged.later is not None:
            srcs, dsts, sizes = staged.later
            staged = self._stage_table([], srcs, dsts, sizes, deadline=deadline, alive=alive)
            if staged.later is not None:  # every ring slot still waits for a launch
                for s, d, n in zip(srcs.tolist(), dsts.tolist(), sizes.tolist(), strict=True):
                    copy(d, s, n, MEMCPY_DEVICE_TO_DEVICE, stream)
                return
        if staged.table is None:
            return
        try:
            self._run(staged.table, staged.rows)
        finally:
            self.discard(staged)

    def discard(self, staged: StagedRows) -> None:
        """``staged`` will not be launched (or just was): its ring slot may be rewritten."""
        if staged.table is not None and staged.slot >= 0:
            self._staged[staged.slot] -= 1
            staged.slot = -1

    def warm(self, chunk_bytes: int) -> None:
        """The one-time set-up now, on the caller's thread, not in a first round: the
        kernel's compile and module load (a module load synchronizes the whole CUDA
        context, so inside a round it waits for whatever a training step queued) and
        tables for a chunk of ``chunk_bytes`` (its most rows: one per tile)."""
        rows = max(1, chunk_bytes // TILE_BYTES)
        if self._ready() and rows > self._capacity:
            self._grow(rows, deadline=time.monotonic() + 60.0, alive=lambda: None)

    def _ready(self) -> bool:
        """Compile the kernel once.

        False (and plain memcpys from then on) where NVRTC is missing.
        """
        if self._kernel is not None:
            return True
        if self._broken:
            return False
        try:
            with self._cp.cuda.Device(self._device):
                kernel = self._cp.RawKernel(_SOURCE, "weightwire_gather")
                kernel.compile()
        except Exception as exc:  # no NVRTC on this host: correct, just slower
            logger.warning(
                "weightwire_ipc: the gather kernel did not compile (%s: %s); "
                "small tensors are copied one memcpy each",
                type(exc).__name__,
                exc,
            )
            self._broken = True
            return False
        self._kernel = kernel
        return True

    def _stage_table(
        self,
        memcpys: list[tuple[int, int, int]],
        srcs: np.ndarray,
        dsts: np.ndarray,
        sizes: np.ndarray,
        *,
        deadline: float,
        alive: Callable[[], None],
    ) -> StagedRows:
        cp = self._cp
        copies = _copies(srcs, dsts, sizes)
        for slot, held in enumerate(self._held):
            # The same copies as a table still on the device: every later upload into that
            # slot is ordered after this launch on the same stream, so it reads this table.
            if held is not None and held.copies == copies:
                self._staged[slot] += 1
                return StagedRows(memcpys, self._tables[slot].device, held.rows, slot)
        tiles = (sizes + (TILE_BYTES - 1)) // TILE_BYTES
        rows = int(tiles.sum())
        slot = self._next
        if (rows > self._capacity and any(self._staged)) or self._staged[slot]:
            # a staged launch still reads that table (or every table, to grow): upload later
            return StagedRows(memcpys, later=(srcs, dsts, sizes))
        if rows > self._capacity:
            self._grow(rows, deadline=deadline, alive=alive)
        table_slot = self._tables[slot]
        host, dev, event = table_slot.host, table_slot.device, table_slot.event
        self._next = (self._next + 1) % self._ring
        self._held[slot] = None  # rewritten below
        # The table's last H2D copy must have run before its pinned memory is rewritten.
        wait_event_host(
            cp, event, deadline=deadline, what="the gather table's previous upload", alive=alive
        )
        table = np.frombuffer(host, dtype=np.uint64, count=3 * rows).reshape(rows, 3)
        seg = np.repeat(np.arange(len(sizes)), tiles)
        first = np.cumsum(tiles) - tiles
        off = (
            np.arange(rows, dtype=np.int64) - first[seg]
        ) * TILE_BYTES  # a tile's offset in its tensor
        table[:, 2] = np.minimum(TILE_BYTES, sizes[seg] - off)
        uoff = off.astype(np.uint64)  # pointers are uint64: int64 + uint64 would go through float64
        table[:, 0] = srcs[seg] + uoff
        table[:, 1] = dsts[seg] + uoff
        cp.cuda.runtime.memcpyAsync(
            dev.data.ptr, table.ctypes.data, table.nbytes, _MEMCPY_HOST_TO_DEVICE, self._stream.ptr
        )
        record(cp, event, self._stream.ptr)  # behind the upload: the pinned rows are free then
        self._held[slot] = _Held(copies, rows)
        self._staged[slot] += 1
        return StagedRows(memcpys, dev, rows, slot)

    def _run(self, table: Any, rows: int) -> None:
        self._kernel(
            (min(rows, _MAX_BLOCKS),), (_THREADS,), (table, np.int64(rows)), stream=self._stream
        )

    def _grow(self, rows: int, *, deadline: float, alive: Callable[[], None]) -> None:
        cp = self._cp
        if self._tables:
            # every queued upload and launch that reads an old table is on this stream: one
            # event behind them all ran before the tables go (a slot's own event is behind
            # its upload only, not behind the kernel that reads it)
            last = self._tables[0].event
            record(cp, last, self._stream.ptr)
            wait_event_host(
                cp,
                last,
                deadline=deadline,
                what="the gather tables' last launch",
                alive=alive,
            )
        self.close()
        capacity = max(256, 1 << (rows - 1).bit_length())
        with cp.cuda.Device(self._device):
            for _ in range(self._ring):
                host = cp.cuda.alloc_pinned_memory(capacity * 24)
                dev = cp.empty(capacity * 3, dtype=cp.uint64)
                event = cp.cuda.runtime.eventCreateWithFlags(CUDA_EVENT_DISABLE_TIMING)
                self._tables.append(_Table(host, dev, event))
        self._capacity = capacity

    def close(self) -> None:
        """Free the tables (after the stream settled: a launch may still read them)."""
        tables, self._tables, self._capacity = self._tables, [], 0
        self._held = [None] * self._ring
        self._staged = [0] * self._ring
        for table in tables:
            try:
                self._cp.cuda.runtime.eventDestroy(table.event)
            except Exception:  # teardown: an event that will not go is the driver's to reclaim
                logger.debug(
                    "weightwire_ipc: destroying a gather-table event failed", exc_info=True
                )
