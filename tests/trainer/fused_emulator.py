"""The fused CUDA delta kernel's host side on CPU: ``trainer.delta_cuda.FusedDelta`` driven
through an emulation of the few CuPy calls it makes, with ``ww_delta`` and ``ww_pack``
done in numpy on host memory (raw pointers of CPU torch tensors and JAX CPU arrays).

What it checks on the way: the launch's grid covers every tile of its table and the tiles
are numbered without gaps, the look-back's status words were zeroed before the launch,
each output region stays inside the scratch allocation, and the pack's grid covers every
byte range. What it does not: the device code itself (``tests/gpu``)."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np

from weightwire.trainer import delta_cuda
from weightwire.trainer.delta_cuda import _COPY, _ENTRY, _PACK_CHUNK, FusedDelta, Tiling

Counts = Callable[[int, int], int]
"""``(changed, capacity) -> count`` the emulated kernel reports (profiling fakes cheap
counts; ``None``: the true count)."""


def _view(ptr: int, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class _Pinned(bytearray):
    """Host memory with a pointer (``alloc_pinned_memory``)."""

    @property
    def ptr(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))


class _Stream:
    _ids = itertools.count(1)

    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = next(self._ids)

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _Array:
    """``cupy.empty``: host memory kept alive by this object, handed to JAX through DLPack
    the way a CuPy array is (numpy's, on the CPU)."""

    def __init__(self, n: int, dtype: Any = np.uint8) -> None:
        dtype = np.dtype(dtype)
        self._buf = _Pinned(max(1, n * dtype.itemsize))
        self._array = np.frombuffer(self._buf, dtype, n)
        self.data = SimpleNamespace(ptr=self._buf.ptr)

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


class Emulator:
    """The emulated CuPy and kernels, with what they saw (``launches``: each launch's
    tensor count, ``allocated``: every scratch size)."""

    def __init__(self, counts: Counts | None = None, compute: bool = True) -> None:
        self.counts = counts
        self.tiling = delta_cuda.TILING
        self.compute = compute
        self.launches: list[int] = []
        self.packs: list[int] = []
        self.pinned_allocs = 0
        self._zeroed: set[int] = set()
        self._table = np.zeros(0, _ENTRY)
        self._events = itertools.count(1)
        runtime = SimpleNamespace(
            memsetAsync=self._memset,
            memcpyAsync=self._memcpy,
            memcpyHostToDevice=1,
            memcpyDeviceToHost=2,
            eventRecord=lambda event, stream: None,
            eventSynchronize=lambda event: None,
            eventCreateWithFlags=lambda flags: next(self._events),
            eventCreate=lambda: next(self._events),
            eventElapsedTime=lambda start, end: 0.5,
            eventDestroy=lambda event: None,
        )
        self.cupy = SimpleNamespace(
            cuda=SimpleNamespace(
                runtime=runtime,
                alloc_pinned_memory=self._pinned,
                Device=_device,
                Stream=_Stream,
            ),
            empty=_Array,
            uint8=np.uint8,
            int32=np.int32,
        )

    def fused(self, device: int = 0, tiling: Tiling | None = None) -> FusedDelta:
        self.tiling = tiling or delta_cuda.TILING
        kernel = FusedDelta.__new__(FusedDelta)
        kernel._setup(self.cupy, device, self.tiling, self._delta, self._pack)
        return kernel

    def _pinned(self, nbytes: int) -> _Pinned:
        self.pinned_allocs += 1
        return _Pinned(nbytes)

    def _memset(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        if self.compute:
            _view(ptr, nbytes)[:] = value
            self._zeroed.add(ptr)

    def _memcpy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        if self.compute:
            ctypes.memmove(dst, src, nbytes)
            return
        # Profiling on meta tensors (no device memory): the table is read on its way in, the
        # counts are made up on their way out.
        if kind == 1 and nbytes % _ENTRY.itemsize == 0:
            self._table = np.frombuffer(_view(src, nbytes).copy(), _ENTRY)
        elif kind == 2:
            fake = self.counts or (lambda changed, capacity: 0)
            got = [fake(int(e["numel"]), int(e["capacity"])) for e in self._table]
            _view(dst, nbytes).view(np.uint64)[:] = got[: nbytes // 8]

    def _delta(self, grid: tuple, block: tuple, args: tuple, stream: Any = None) -> None:
        table_ptr, n, ticket, counts_ptr, status = (int(a) for a in args)
        assert block == (self.tiling.threads,)
        self.launches.append(n)
        if not self.compute:
            return
        table = np.frombuffer(_view(table_ptr, n * _ENTRY.itemsize).copy(), _ENTRY)
        assert ticket in self._zeroed
        tiles = table["tiles"]
        assert list(table["first_tile"]) == list(np.cumsum(tiles) - tiles)
        for e in table:  # a tile: threads x vec 16-byte vectors of one tensor
            assert int(e["tiles"]) == self.tiling.tiles(int(e["numel"]), int(e["itemsize"]))
        assert grid == (int(tiles.sum()),)
        assert not _view(status, 8 * grid[0]).any()
        counts = _view(counts_ptr, 8 * n).view(np.uint64)
        for j, e in enumerate(table):
            size, numel, capacity = int(e["itemsize"]), int(e["numel"]), int(e["capacity"])
            word = np.dtype(f"u{size}")
            fresh = _view(int(e["fresh"]), numel * size).view(word)
            base = _view(int(e["base"]), numel * size).view(word)
            changed = np.flatnonzero(fresh != base)
            k = min(changed.size, capacity)
            _view(int(e["index"]), 4 * k).view(np.int32)[:] = changed[:k]
            _view(int(e["values"]), size * k).view(word)[:] = fresh[changed[:k]]
            base[:] = fresh
            counts[j] = self.counts(changed.size, capacity) if self.counts else changed.size

    def _pack(self, grid: tuple, block: tuple, args: tuple, stream: Any = None) -> None:
        table_ptr, n = int(args[0]), int(args[1])
        self.packs.append(n)
        if not self.compute:
            return
        copies = np.frombuffer(_view(table_ptr, n * _COPY.itemsize).copy(), _COPY)
        assert grid[0] * _PACK_CHUNK >= int(copies["bytes"].max()) and grid[1] >= 1
        for c in copies:
            ctypes.memmove(int(c["dst"]), int(c["src"]), int(c["bytes"]))


@contextmanager
def _device(ordinal: int) -> Iterator[None]:
    yield


@contextmanager
def emulated(monkeypatch: Any, emulator: Emulator) -> Iterator[Emulator]:
    """Route ``delta_cuda.fused`` to ``emulator`` and let the torch and JAX callers take CPU
    tensors on the fused path."""
    kernels: dict[int, FusedDelta] = {}

    def fused(device: int | None, tiling: Tiling | None = None) -> FusedDelta:
        key = device or 0
        if key not in kernels:
            kernels[key] = emulator.fused(key, tiling)
        return kernels[key]

    monkeypatch.setattr(delta_cuda, "fused", fused)
    monkeypatch.setattr(delta_cuda, "available", lambda: True)
    yield emulator
