"""The real gather kernel (``weightwire.backends.ipc.gather``) on a GPU: bytes equal to the
host's concatenation for tensors of every size class, 16-byte aligned and not (odd
sources, an odd destination, odd lengths, tiles and their tails), more rows than blocks, and the
same chunk with the kernel switched off."""

from __future__ import annotations

import time

import numpy as np
import pytest

from weightwire.backends.device import DeviceBytes


def _run(sizes: list[int], *, dst_offset: int, src_skew: bool, kernel: bool = True) -> None:
    import cupy as cp

    from weightwire.backends.ipc.gather import GatherCopy

    rng = np.random.default_rng(len(sizes))
    host = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    keep, regions = [], []
    for i, h in enumerate(host):
        skew = (i % 5) if src_skew else 0
        arr = cp.empty(h.size + skew, dtype=cp.uint8)
        arr[skew:] = cp.asarray(h)
        keep.append(arr)
        regions.append(DeviceBytes(arr.data.ptr + skew, h.size, 0, None))
    want = np.concatenate(host) if host else np.empty(0, np.uint8)
    out = cp.zeros(want.size + dst_offset + 16, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    gather = GatherCopy(cp, 0, stream.ptr)
    gather.copy(
        out.data.ptr + dst_offset, regions, deadline=time.monotonic() + 60, alive=lambda: None
    )
    stream.synchronize()
    got = cp.asnumpy(out[dst_offset : dst_offset + want.size])
    assert (gather._kernel is not None) == kernel  # the kernel really ran (or really did not)
    gather.close()
    assert np.array_equal(got, want), f"first differing byte at {int(np.argmax(got != want))}"
    assert not cp.asnumpy(out[dst_offset + want.size :]).any()  # nothing written past the chunk


@pytest.mark.gpu
@pytest.mark.parametrize(("dst_offset", "src_skew"), [(0, False), (1, True), (6, False)])
def test_gather_kernel_copies_every_size_and_alignment_exactly(
    dst_offset: int, src_skew: bool
) -> None:
    sizes = [
        896 * 2,
        128 * 2,
        1,
        3,
        17,
        4096,
        (4 << 20) - 1,
        4 << 20,
        (4 << 20) + 3,
        229_376,
        0,
        15,
        16,
        33,
        1 << 20,
        (64 << 10) + 1,
        (64 << 20) + 3,
    ]  # a tile and a byte; over the kernel's limit (a memcpy)
    _run(sizes * 3, dst_offset=dst_offset, src_skew=src_skew)


@pytest.mark.gpu
def test_gather_kernel_takes_a_table_of_more_rows_than_blocks() -> None:
    _run(
        [1, 2, 3, 16] * 17_000, dst_offset=3, src_skew=False
    )  # 68,000 rows for at most 4,096 blocks


@pytest.mark.gpu
def test_gather_switched_off_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTWIRE_IPC_GATHER", "0")
    _run([100 + i for i in range(40)], dst_offset=1, src_skew=True, kernel=False)
