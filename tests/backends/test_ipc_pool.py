"""``ReceivePool`` (pull mode's worker buffers) on CPU with a fake CUDA runtime: the
size classes, reuse once torch's last reference is gone (never before), the free event
recorded at each reuse, handles announced once, release-after-round, and that a buffer
the trainer may still be writing is never freed."""

from __future__ import annotations

import gc
import threading
from contextlib import nullcontext
from typing import Any

import pytest

from weightwire.backends.ipc.pool import ALIGN, ReceivePool, size_class
from weightwire.shared.errors import TransferError

MIB = 1 << 20


class Runtime:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._next = 0

    def malloc(self, n: int) -> int:
        self._next += 1
        ptr = self._next << 40
        self.log.append(("malloc", ptr, n))
        return ptr

    def free(self, ptr: int) -> None:
        self.log.append(("free", ptr))

    def eventCreateWithFlags(self, flags: int) -> int:  # CUDA's names
        self._next += 1
        return self._next

    def eventDestroy(self, e: int) -> None:
        self.log.append(("destroy", e))

    def eventRecord(self, e: int, stream: int) -> None:
        self.log.append(("record", e, stream))

    def ipcGetMemHandle(self, ptr: int) -> bytes:
        return ptr.to_bytes(8, "little") * 8

    def ipcGetEventHandle(self, e: int) -> bytes:
        return e.to_bytes(8, "little") * 8


class Cupy:
    def __init__(self) -> None:
        self.cuda = type("cuda", (), {})()
        self.cuda.runtime = Runtime()
        self.cuda.Device = lambda i: nullcontext()


def _pool() -> tuple[ReceivePool, Runtime]:
    cp = Cupy()
    return ReceivePool(cp, 0), cp.cuda.runtime


def test_size_classes_bound_the_waste_and_group_near_equal_chunks() -> None:
    assert size_class(1) == ALIGN and size_class(3 * MIB) == 4 * MIB
    assert size_class(942 * MIB) == 1024 * MIB == size_class(1024 * MIB)
    assert size_class(1024 * MIB + 1) == size_class(1024 * MIB + 112 * MIB) == 1280 * MIB
    for n in (5, 77 * MIB, 1000 * MIB, 3 << 30):
        assert n <= size_class(n) <= n * 1.25 + ALIGN
    with pytest.raises(ValueError, match="at least one byte"):
        size_class(0)


def test_a_buffer_is_reused_only_after_its_lease_died() -> None:
    pool, rt = _pool()
    a = pool.acquire(100 * MIB, stream_ptr=7)
    first = pool.describe(a)
    assert (
        set(first) == {"b", "cap", "h", "f"}
        and first["cap"] == a.nbytes
        and pool.describe(a) == {"b": a.id}
    )  # handles once per session
    lease = pool.lease(a, 100 * MIB)
    assert lease.__cuda_array_interface__["data"] == (a.ptr, False)
    assert lease.__cuda_array_interface__["shape"] == (100 * MIB,)
    b = pool.acquire(100 * MIB, stream_ptr=7)  # a is still held: a second buffer
    assert b.id != a.id and len(pool) == 2
    del lease
    gc.collect()
    pool.lease(b, 1)  # b leased too (and its lease dropped at once)
    c = pool.acquire(90 * MIB, stream_ptr=9)  # same class: a (or b) again, no new allocation
    assert c.id in (a.id, b.id) and len([e for e in rt.log if e[0] == "malloc"]) == 2
    assert rt.log[-1] == (
        "record",
        c.event,
        9,
    )  # ordered after its last readers on the given stream


def test_release_after_round_frees_free_buffers_now_and_leased_ones_on_return() -> None:
    pool, rt = _pool()
    a, b = pool.acquire(10 * MIB, 0), pool.acquire(10 * MIB, 0)
    held = pool.lease(a, 10 * MIB)
    pool.lease(b, 10 * MIB)
    pool.retire_all()
    assert [e for e in rt.log if e[0] == "free"] == [("free", b.ptr)]
    del held
    gc.collect()
    assert [e for e in rt.log if e[0] == "free"] == [("free", b.ptr), ("free", a.ptr)]
    d = pool.acquire(10 * MIB, 0)  # the next round: a fresh buffer with a new id, announced again
    assert d.id not in (a.id, b.id) and "h" in pool.describe(d)


def test_close_never_frees_a_buffer_the_trainer_may_be_writing() -> None:
    pool, rt = _pool()
    filling = pool.acquire(4 * MIB, 0)
    done = pool.acquire(4 * MIB, 0)
    pool.lease(done, 4 * MIB)
    assert pool.close() == filling.nbytes  # reported as left allocated
    freed = [e[1] for e in rt.log if e[0] == "free"]
    assert freed == [done.ptr]
    with pytest.raises(TransferError, match="pool is closed"):
        pool.acquire(1, 0)


def test_a_lease_dropped_on_another_thread_returns_the_buffer() -> None:
    pool, _ = _pool()
    a = pool.acquire(MIB, 0)
    box: list[Any] = [pool.lease(a, MIB)]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join(10)
    gc.collect()
    again = pool.acquire(MIB, 0)
    assert again.id == a.id
    keep = pool.lease(again, MIB)
    with pytest.raises(
        TransferError, match="is leased, not filling"
    ):  # handed to torch twice: refused
        pool.lease(again, MIB)
    del keep


# -- leased ahead of the fill (the worker's views made before the ready message) --------------


def test_a_buffer_leased_ahead_is_not_free_before_filled_even_if_its_lease_died() -> None:
    pool, rt = _pool()
    a = pool.acquire(4 * MIB, 0)
    lease = pool.lease(a, 4 * MIB, ahead=True)
    assert a.state == "filling"  # the trainer may still be writing it
    with pytest.raises(TransferError, match="already leased ahead of its fill"):
        pool.lease(a, 4 * MIB)  # one lease per fill
    del lease  # e.g. the round failed while waiting for the ready message
    gc.collect()
    assert a.state == "filling" and pool.acquire_free(4 * MIB, 0) is None  # not handed out again
    assert pool.close() == a.nbytes and not [
        e for e in rt.log if e[0] == "free"
    ]  # leaked, never freed


def test_filled_turns_a_lease_ahead_into_an_ordinary_one() -> None:
    pool, _ = _pool()
    a = pool.acquire(4 * MIB, 0)
    lease = pool.lease(a, 4 * MIB, ahead=True)
    pool.filled(a)
    assert a.state == "leased" and pool.acquire_free(4 * MIB, 0) is None
    del lease
    gc.collect()
    assert a.state == "free" and pool.acquire_free(4 * MIB, 0) is a
    with pytest.raises(TransferError, match="was not leased ahead of its fill"):
        pool.filled(a)


def test_a_lease_ahead_that_died_before_filled_frees_the_buffer_at_filled() -> None:
    pool, _ = _pool()
    a = pool.acquire(4 * MIB, 0)
    lease = pool.lease(a, 4 * MIB, ahead=True)
    del lease
    gc.collect()
    pool.filled(a)  # the fill is over: nothing writes into it any more
    assert a.state == "free" and pool.acquire_free(4 * MIB, 0) is a
