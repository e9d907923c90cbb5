"""``GatherCopy`` on CPU: a fake CUDA runtime over one simulated device memory, whose gather
"kernel" walks the uploaded table exactly as the real one does (source, destination,
bytes per row). Checked: the chunk's bytes land back to back whatever the mix of small
and large tensors, the small ones go through one table upload and one launch (large
ones keep their memcpy), too few small ones and a host without NVRTC fall back to one
memcpy each, a pinned table is rewritten only after its last upload completed, and the
``WEIGHTWIRE_IPC_GATHER`` switch.
"""

from __future__ import annotations

import ctypes
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest

from weightwire.backends.device import DeviceBytes
from weightwire.backends.ipc import gather as gather_mod
from weightwire.backends.ipc.gather import MIN_BATCH, GatherCopy

SMALL = 1 << 20  # the tests' threshold (monkeypatched): below it the kernel, from it a memcpy
TILE = 4096
MEM = 5 * SMALL + (1 << 20)


@pytest.fixture(autouse=True)
def small_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gather_mod, "SMALL_BYTES", SMALL)
    monkeypatch.setattr(gather_mod, "TILE_BYTES", TILE)


class Device:
    """One simulated device memory (addresses are offsets into it) and a bump allocator."""

    def __init__(self) -> None:
        self.mem = bytearray(MEM)
        self.top = 64

    def alloc(self, n: int) -> int:
        ptr, self.top = self.top, self.top + n + 64
        assert self.top <= MEM
        return ptr


class Runtime:
    CUDARuntimeError = RuntimeError

    def __init__(self, dev: Device, log: list) -> None:
        self.dev, self.log, self.pending = dev, log, 0

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        if kind == 1:  # host -> device: the table, read from real (pinned) host memory
            self.dev.mem[dst : dst + n] = ctypes.string_at(src, n)
            self.log.append(("upload", n // 24))
        else:
            self.dev.mem[dst : dst + n] = self.dev.mem[src : src + n]
            self.log.append(("memcpy", n))

    def eventCreateWithFlags(self, flags: int) -> int:  # CUDA's names
        self.log.append(("event",))
        return 900 + len(self.log)

    def eventRecord(self, event: int, stream: int) -> None:
        self.log.append(("record", event))

    def eventQuery(self, event: int) -> int:
        self.log.append(("query", event))
        if self.pending:  # still queued: the caller must wait for it
            self.pending -= 1
            return 600
        return 0

    def eventDestroy(self, event: int) -> None:
        self.log.append(("destroy", event))


class Array:
    def __init__(self, ptr: int) -> None:
        self.data = type("D", (), {"ptr": ptr})()


class Kernel:
    def __init__(self, cp: FakeCupy, source: str, name: str) -> None:
        assert name in source
        self.cp = cp

    def compile(self) -> None:
        if self.cp.no_nvrtc:
            raise RuntimeError("libnvrtc.so.12: cannot open shared object file")

    def __call__(self, grid: tuple, block: tuple, args: tuple, stream: Any = None) -> None:
        table, rows = args
        rows = int(rows)
        assert 1 <= grid[0] <= rows and stream.ptr == 7  # blocks stride over the rows
        mem = self.cp.dev.mem
        words = np.frombuffer(
            bytes(mem[table.data.ptr : table.data.ptr + 24 * rows]), dtype=np.uint64
        )
        for src, dst, n in words.reshape(rows, 3).tolist():
            assert 0 < n <= TILE
            mem[dst : dst + n] = mem[src : src + n]
        self.cp.log.append(("launch", rows))


class FakeCupy:
    uint64 = np.uint64

    def __init__(self, *, no_nvrtc: bool = False) -> None:
        self.dev, self.log, self.no_nvrtc = Device(), [], no_nvrtc
        self.cuda = type("cuda", (), {})()
        self.cuda.runtime = Runtime(self.dev, self.log)
        self.cuda.Device = lambda i: nullcontext()
        self.cuda.alloc_pinned_memory = lambda n: bytearray(n)

    def RawKernel(self, source: str, name: str) -> Kernel:  # CuPy's name
        return Kernel(self, source, name)

    def empty(self, n: int, dtype: Any) -> Array:
        return Array(self.dev.alloc(n * 8))


def _tensors(cp: FakeCupy, sizes: list[int]) -> tuple[list[DeviceBytes], bytes]:
    rng = np.random.default_rng(sum(sizes))
    regions, want = [], b""
    for n in sizes:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        ptr = cp.dev.alloc(n) + (n % 3)  # odd source addresses too
        cp.dev.mem[ptr : ptr + n] = data
        regions.append(DeviceBytes(ptr, n, 0, None))
        want += data
    return regions, want


def _copy(cp: FakeCupy, sizes: list[int], gc: GatherCopy | None = None) -> GatherCopy:
    regions, want = _tensors(cp, sizes)
    gc = gc or GatherCopy(cp, 0, 7)
    dst = cp.dev.alloc(len(want)) + 1  # an unaligned destination
    gc.copy(dst, regions, deadline=time.monotonic() + 5, alive=lambda: None)
    assert bytes(cp.dev.mem[dst : dst + len(want)]) == want
    return gc


def test_small_tensors_go_through_one_table_of_tiles_and_large_ones_keep_their_memcpy() -> None:
    cp = FakeCupy()
    sizes = [SMALL, 1792, 256, 0, 3, SMALL + 5, 3 * TILE + 1, TILE] + [100 + i for i in range(10)]
    _copy(cp, sizes)
    ops = [e for e in cp.log if e[0] in ("memcpy", "upload", "launch")]
    rows = (
        3 + 4 + 1 + 10
    )  # 1792, 256, 3 B: a row each; 3 tiles + 1 B: four; one full tile; ten more
    # the table is uploaded when the copies are staged, before anything is written
    assert ops == [("upload", rows), ("memcpy", SMALL), ("memcpy", SMALL + 5), ("launch", rows)]


def test_a_few_small_tensors_and_a_host_without_nvrtc_copy_one_memcpy_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cp = FakeCupy()
    _copy(cp, [10] * (MIN_BATCH - 1))
    assert [e[0] for e in cp.log if e[0] != "event"] == ["memcpy"] * (MIN_BATCH - 1)
    cp = FakeCupy(no_nvrtc=True)
    gc = _copy(cp, [10] * 20)
    _copy(cp, [11] * 20, gc)  # compiled (and refused) once, not per chunk
    assert [e[0] for e in cp.log] == ["memcpy"] * 40
    assert [r.message for r in caplog.records].count(
        "weightwire_ipc: the gather kernel did not compile "
        "(RuntimeError: libnvrtc.so.12: cannot open shared object file); "
        "small tensors are copied one memcpy each"
    ) == 1


def test_a_pinned_table_is_rewritten_only_after_its_last_upload_ran() -> None:
    cp = FakeCupy()
    gc = None
    for k in range(gather_mod._RING):
        gc = _copy(cp, [10 + k] * 9, gc)
    records = [e[1] for e in cp.log if e[0] == "record"]
    assert len(set(records)) == gather_mod._RING  # a table per ring slot
    cp.cuda.runtime.pending = 2  # the first table's upload is still queued twice over
    _copy(cp, [20] * 9, gc)
    assert [e for e in cp.log if e[0] == "query"][-3:] == [
        ("query", records[0])
    ] * 3  # polled until done
    grow = [e for e in cp.log if e[0] in ("destroy", "event")]
    _copy(
        cp, [13] * 300, gc
    )  # more rows than the tables hold: new tables, the old ones settled first
    assert [e[0] for e in cp.log if e[0] in ("destroy", "event")][len(grow) :] == (
        ["destroy"] * gather_mod._RING + ["event"] * gather_mod._RING
    )


def test_the_same_copies_again_launch_on_the_table_still_on_the_device() -> None:
    cp = FakeCupy()
    regions, _ = _tensors(cp, [100 + i for i in range(12)])
    total = sum(r.nbytes for r in regions)
    dst = cp.dev.alloc(total) + 1
    gc = GatherCopy(cp, 0, 7)

    def fill(seed: int) -> bytes:  # new bytes at the same addresses (a trainer step in place)
        data = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8).tobytes()
        off = 0
        for r in regions:
            cp.dev.mem[r.ptr : r.ptr + r.nbytes] = data[off : off + r.nbytes]
            off += r.nbytes
        gc.copy(dst, regions, deadline=time.monotonic() + 5, alive=lambda: None)
        assert bytes(cp.dev.mem[dst : dst + total]) == data
        return data

    fill(1)
    uploads = len([e for e in cp.log if e[0] == "upload"])
    fill(2)
    fill(3)
    assert (
        len([e for e in cp.log if e[0] == "upload"]) == uploads == 1
    )  # launched on the kept table
    assert len([e for e in cp.log if e[0] == "launch"]) == 3
    # Another destination is another table; enough other tables push the first one out.
    for k in range(gather_mod._RING):
        _copy(cp, [50 + k] * 9, gc)
    fill(4)  # uploaded again, still right
    assert len([e for e in cp.log if e[0] == "upload"]) == 1 + gather_mod._RING + 1


def test_the_switch_turns_the_kernel_off_and_refuses_other_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WEIGHTWIRE_IPC_GATHER", "0")
    cp = FakeCupy()
    _copy(cp, [10] * 20)
    assert {e[0] for e in cp.log} == {"memcpy"}
    monkeypatch.setenv("WEIGHTWIRE_IPC_GATHER", "yes")
    with pytest.raises(ValueError, match="WEIGHTWIRE_IPC_GATHER must be '0' or '1', got 'yes'"):
        gather_mod.GatherCopy(cp, 0, 7)
