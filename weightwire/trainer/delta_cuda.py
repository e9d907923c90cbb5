"""Fused delta extraction on a CUDA device, shared by the JAX and the torch trainer.

One pass over a layer group's new weights and base per round (``delta_cuda_source``: one
launch per group): compare bit patterns, count per tensor, compact each tensor's changed
elements (``int32`` flat indices and values, in increasing index order) into a scratch
region sized by the tensor's patch limit, and write the changed elements into the base.
The counts come back with one host sync per group; the caller can start the next group
before waiting on this one (``DeltaTracker.build`` does), so the device does not idle on
the sync. Then ``pack`` copies the tensors that go as patches out of the scratch into tight
buffers the caller allocated (one launch), and the scratch is released.

Framework-neutral: tensors reach it as raw device pointers (``Operand``), device memory
comes from the caller's allocator (stream-ordered on the stream it launches on: torch's
caching allocator on torch's current stream, CuPy's pool on the JAX kernel's own stream),
and every launch goes on the caller's stream. CuPy is imported on first use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightwire.shared.errors import ConfigError
from weightwire.trainer.delta_cuda_source import SOURCE

THREADS = 256
VEC = 4
"""16-byte vectors per operand per thread: a tile is THREADS x VEC x 16 bytes of each."""
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

    def tiles(self, vec: int = VEC) -> int:
        return -(-self.numel // (THREADS * vec * 16 // self.itemsize))


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


class _StreamRef:
    """What a CuPy kernel launch reads a stream from (its ``ptr``): a stream by pointer."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming


class FusedDelta:
    """The compiled kernels on one CUDA device (compiled on first use)."""

    def __init__(self, device: int, vec: int = VEC) -> None:
        if vec not in (1, 2, 4):
            raise ConfigError(f"vec must be 1, 2 or 4, got {vec}")
        import cupy

        self._cp = cupy
        self.device = int(device)
        self.vec = vec
        with cupy.cuda.Device(self.device):
            module = cupy.RawModule(code=SOURCE, options=("-std=c++17", f"-DWW_VEC={vec}"))
            self._delta = module.get_function("ww_delta")
            self._pack = module.get_function("ww_pack")
        self._events: list[int] = []
        """Idle CUDA events (a group's counts are read after one), reused."""

    def launch(self, operands: Sequence[Operand], stream: int, alloc: Alloc, keep: Any) -> Pending:
        """Enqueue the group on ``stream`` (a raw CUDA stream pointer); nothing waits."""
        cp = self._cp
        ops = list(operands)
        n = len(ops)
        table = np.zeros(n, _ENTRY)
        tiles = [op.tiles(self.vec) for op in ops]
        total = sum(tiles)
        table_bytes = _up(max(1, n) * _ENTRY.itemsize)
        zeroed = _up(16 + 8 * n) + 8 * total  # ticket, counts, tile status words
        copies_at = table_bytes + _up(zeroed)
        at = copies_at + _up(2 * n * _COPY.itemsize)
        outputs = []
        for op in ops:
            index_at = at
            at += _up(4 * op.limit)
            outputs.append((index_at, at))
            at += _up(op.itemsize * op.limit)
        scratch_ptr, scratch = alloc(at)
        first = 0
        for i, (op, t) in enumerate(zip(ops, tiles, strict=True)):
            aligned = op.new % _ALIGN == 0 and op.base % _ALIGN == 0
            table[i] = (
                op.new, op.base, scratch_ptr + outputs[i][0], scratch_ptr + outputs[i][1],
                op.numel, op.limit, first, t, op.itemsize, int(aligned),
            )  # fmt: skip
            first += t
        host = cp.cuda.alloc_pinned_memory(max(8, 8 * n))
        counts_view = np.frombuffer(host, np.uint64, n)
        runtime = cp.cuda.runtime
        with cp.cuda.Device(self.device):
            ticket = scratch_ptr + table_bytes
            counts = ticket + 16
            status = ticket + _up(16 + 8 * n)
            runtime.memsetAsync(ticket, 0, zeroed, stream)
            if n:
                runtime.memcpyAsync(
                    scratch_ptr, table.ctypes.data, table.nbytes, runtime.memcpyHostToDevice, stream
                )
            if total:
                self._delta(
                    (total,),
                    (THREADS,),
                    (np.uint64(scratch_ptr), np.int32(n), np.uint64(ticket), np.uint64(counts),
                     np.uint64(status)),
                    stream=_StreamRef(stream),
                )  # fmt: skip
            if n:
                runtime.memcpyAsync(host.ptr, counts, 8 * n, runtime.memcpyDeviceToHost, stream)
            event = self._event()
            runtime.eventRecord(event, stream)
        return Pending(
            ops, stream, scratch, scratch_ptr, outputs, copies_at, host, counts_view, event, keep
        )

    def counts(self, pending: Pending) -> list[int]:
        """The group's changed-element counts (waits for its launch: the host sync)."""
        self._cp.cuda.runtime.eventSynchronize(pending.event)
        self._events.append(pending.event)
        pending.event = None
        return pending.counts_view.tolist()

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
                runtime.memcpyAsync(
                    dst, table.ctypes.data, table.nbytes, runtime.memcpyHostToDevice,
                    pending.stream,
                )  # fmt: skip
                self._pack(
                    grid,
                    (_PACK_THREADS,),
                    (np.uint64(dst), np.int32(len(copies))),
                    stream=_StreamRef(pending.stream),
                )
        # Stream-ordered memory: a later allocation on this stream reuses it only after
        # the copy above ran.
        pending.scratch = None
        pending.keep = None

    def _event(self) -> int:
        if self._events:
            return self._events.pop()
        return int(self._cp.cuda.runtime.eventCreateWithFlags(_EVENT_DISABLE_TIMING))


_COMPILED: dict[tuple[int, int], FusedDelta] = {}


def fused(device: int, vec: int = VEC) -> FusedDelta:
    """The kernels for ``device`` (compiled once per process)."""
    got = _COMPILED.get((device, vec))
    if got is None:
        got = _COMPILED[(device, vec)] = FusedDelta(device, vec)
    return got
