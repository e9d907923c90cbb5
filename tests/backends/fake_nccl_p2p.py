"""An in-process NCCL world for CPU tests: ranks are threads, device memory is host memory,
and point-to-point ``send`` / ``recv`` (and ``broadcast``) really move bytes between the ranks'
buffers.

It stands in for the parts of CuPy that ``NCCLCommunicator`` and the sliced data path touch
(streams, events, ``empty`` / ``asarray``, ``memcpyAsync``, ``nccl.groupStart`` /
``groupEnd``). A ``send`` copies its bytes out when it is enqueued; a ``recv`` takes the
next message from its peer (NCCL's per-pair order, whatever the stream) once it arrived:
an event recorded after it is done only then, so a missing sender makes the communicator's
watchdog time out as on a GPU. A message whose size differs from the receive is an error
(NCCL would hang or corrupt), raised from the receiver's wait.

NCCL connects a pair of ranks at their first point-to-point call, on the host, and each
side waits there for the other: so the first ``send`` / ``recv`` between two ranks blocks
until the peer made its own first call to this rank (``CONNECT_S`` at most, then an
``AssertionError`` naming the deadlock a GPU would never leave).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from weightwire.backends.device import DeviceBytes
from weightwire.backends.nccl.comm import NCCLCommunicator
from weightwire.backends.nccl.library import NCCL_ITEMSIZE


class FakeDeviceArray:
    """A CuPy-like uint8 array backed by numpy (``data.ptr`` is a real host address)."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.nbytes, self.shape, self.strides = host.nbytes, host.shape, host.strides
        self.data = SimpleNamespace(ptr=host.ctypes.data)
        self.device = SimpleNamespace(id=0)
        self.flags = SimpleNamespace(c_contiguous=True)

    def __getitem__(self, key: slice) -> FakeDeviceArray:
        return FakeDeviceArray(self.host[key])

    def get(self) -> np.ndarray:
        return self.host.copy()


CONNECT_S = 10.0
_STREAMS = itertools.count(0x9000)


class World:
    """The shared state of one fake NCCL group: each ordered pair's messages."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.arrived = threading.Condition(self.lock)
        self.calls: set[tuple[int, int]] = set()  # (rank, peer): rank called with peer
        self.mail: dict[tuple[int, int], list[bytes]] = {}
        self.taken: dict[tuple[int, int], int] = {}
        self.pending: dict[tuple[int, int], list[_Recv]] = {}  # (rank, stream) -> receives
        self.sent_bytes = [0] * size
        self.aborted: set[int] = set()

    def comm(self, rank: int) -> NCCLCommunicator:
        return NCCLCommunicator(
            FakeP2PComm(self, rank), rank=rank, world_size=self.size, device=0,
            cp=FakeP2PCupy(self, rank), version="2.28.9",
        )  # fmt: skip

    def connect(self, rank: int, peer: int) -> None:
        """NCCL's lazy connection setup: wait until ``peer`` made a call with ``rank``."""
        deadline = time.monotonic() + CONNECT_S
        with self.arrived:
            self.calls.add((rank, peer))
            self.arrived.notify_all()
            while (peer, rank) not in self.calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"rank {rank}'s first call with rank {peer} waited {CONNECT_S:g} s for "
                        "the peer's: NCCL's connection setup would hang here"
                    )
                self.arrived.wait(left)

    def done(self, rank: int, ops: list[_Recv]) -> bool:
        with self.lock:
            for op in ops:
                if op.done:
                    continue
                box = self.mail.get((op.src, rank), [])
                if len(box) <= op.ticket:
                    return False
                message = box[op.ticket]
                if len(message) != op.nbytes:
                    raise AssertionError(
                        f"rank {rank} receives {op.nbytes} bytes from rank {op.src}, "
                        f"which sent {len(message)}"
                    )
                ctypes.memmove(op.ptr, message, op.nbytes)
                op.done = True
            return True


class _Recv:
    def __init__(self, src: int, ticket: int, ptr: int, nbytes: int) -> None:
        self.src, self.ticket, self.ptr, self.nbytes, self.done = src, ticket, ptr, nbytes, False


class FakeP2PComm:
    """CuPy's ``NcclCommunicator`` surface the communicator calls, for one rank."""

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank

    def allReduce(self, *args: object) -> None:  # the warm-up: nothing to move
        return None

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        assert dtype == 1, "the sliced data path sends uint8"
        w = self.world
        w.connect(self.rank, peer)
        with w.lock:
            w.mail.setdefault((self.rank, peer), []).append(ctypes.string_at(ptr, count))
            w.sent_bytes[self.rank] += count

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        assert dtype == 1, "the sliced data path receives uint8"
        w = self.world
        w.connect(self.rank, peer)
        with w.lock:
            ticket = w.taken.get((peer, self.rank), 0)
            w.taken[(peer, self.rank)] = ticket + 1
            w.pending.setdefault((self.rank, stream), []).append(_Recv(peer, ticket, ptr, count))

    def broadcast(
        self, sendptr: int, recvptr: int, count: int, dtype: int, root: int, stream: int
    ) -> None:
        """Root: its bytes into every peer's mail from it; a peer: the next one from root
        (a broadcast keeps the per-pair order as point-to-point calls do)."""
        nbytes = count * NCCL_ITEMSIZE[dtype]
        w = self.world
        with w.lock:
            if self.rank == root:
                data = ctypes.string_at(sendptr, nbytes)
                for peer in range(w.size):
                    if peer != root:
                        w.mail.setdefault((root, peer), []).append(data)
                        w.sent_bytes[root] += nbytes
                return
            ticket = w.taken.get((root, self.rank), 0)
            w.taken[(root, self.rank)] = ticket + 1
            op = _Recv(root, ticket, recvptr, nbytes)
            w.pending.setdefault((self.rank, stream), []).append(op)

    def check_async_error(self) -> None:
        return None

    def abort(self) -> None:
        self.world.aborted.add(self.rank)


class _Stream:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class FakeP2PCupy:
    """The CuPy module as one rank of ``World`` sees it."""

    uint8 = np.uint8
    float32 = np.float32
    ndarray = FakeDeviceArray

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank = world, rank
        fake = self

        class Device:
            def __init__(self, index: int = 0) -> None:
                self.index = index

            def use(self) -> None:
                return None

            def __enter__(self) -> Device:
                return self

            def __exit__(self, *exc: object) -> None:
                return None

        class Stream(_Stream):
            def __init__(self, non_blocking: bool = False) -> None:
                super().__init__(next(_STREAMS))

        class ExternalStream(_Stream):
            def __init__(self, ptr: int, device_id: int = -1) -> None:
                super().__init__(ptr)

        class Event:
            def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
                self.ops: list[_Recv] = []

            def record(self, stream: _Stream) -> None:
                with fake.world.lock:
                    self.ops = list(fake.world.pending.get((fake.rank, stream.ptr), []))

            @property
            def done(self) -> bool:
                return fake.world.done(fake.rank, self.ops)

        def memcpy(dst: int, src: int, n: int, kind: int, stream: int) -> None:
            ctypes.memmove(dst, src, n)

        runtime = SimpleNamespace(
            getDeviceCount=lambda: 1,
            getDevice=lambda: 0,
            memcpyAsync=memcpy,
            memcpyDeviceToDevice=3,
        )
        nccl = SimpleNamespace(groupStart=lambda: None, groupEnd=lambda: None)
        self.cuda = SimpleNamespace(
            Device=Device,
            Event=Event,
            Stream=Stream,
            ExternalStream=ExternalStream,
            runtime=runtime,
            nccl=nccl,
        )

    def empty(self, n: int, dtype: Any = np.uint8) -> FakeDeviceArray:
        return FakeDeviceArray(np.empty(n, dtype=np.uint8))

    def zeros(self, n: int, dtype: Any = np.float32) -> FakeDeviceArray:
        return FakeDeviceArray(np.zeros(n, dtype=np.uint8))

    def asarray(self, data: Any, dtype: Any = None) -> FakeDeviceArray:
        return FakeDeviceArray(np.array(data, dtype=np.uint8).reshape(-1))

    def get_default_memory_pool(self) -> Any:
        return SimpleNamespace(free_all_blocks=lambda: None)


class HostPacker:
    """A ``DevicePacker`` over host memory: a piece's own bytes by address (numpy, torch or
    JAX CPU arrays), what a GPU packer gives of a device array."""

    ordinal = 0

    def __init__(self, cp: FakeP2PCupy) -> None:
        self._cp = cp

    def new_stream(self) -> Any:
        return self._cp.cuda.Stream(non_blocking=True)

    def regions(self, tensors: Any, stream: Any) -> list[DeviceBytes]:
        out = []
        for t in tensors:
            if hasattr(t, "unsafe_buffer_pointer"):  # a JAX CPU array
                t.block_until_ready()
                out.append(DeviceBytes(int(t.unsafe_buffer_pointer()), int(t.nbytes), None, t))
            elif hasattr(t, "data_ptr"):  # a torch CPU tensor
                assert t.is_contiguous()
                out.append(DeviceBytes(t.data_ptr(), t.numel() * t.element_size(), None, t))
            elif isinstance(t, FakeDeviceArray):
                out.append(DeviceBytes(t.data.ptr, t.nbytes, None, t))
            else:
                a = np.ascontiguousarray(t)
                out.append(DeviceBytes(a.ctypes.data, a.nbytes, None, a))
        return out


@contextmanager
def in_process_nccl(monkeypatch: pytest.MonkeyPatch, size: int) -> Iterator[World]:
    """``weightwire_nccl`` joined in process: ``size`` ranks (rank 0 the trainer) of one
    ``World``, the trainer's framework lent a ``HostPacker``, CPU workers allowed."""
    import weightwire.backends.nccl.trainer as nccl_trainer
    import weightwire.backends.nccl.worker as nccl_worker

    world = World(size)
    joined: dict[int, NCCLCommunicator] = {}

    def join(**kw: Any) -> NCCLCommunicator:
        assert kw["world_size"] == size
        comm = joined[kw["rank"]] = world.comm(kw["rank"])
        return comm

    monkeypatch.setattr(NCCLCommunicator, "join", staticmethod(join))
    monkeypatch.setattr(nccl_trainer, "nccl_available", lambda: True)
    monkeypatch.setattr(nccl_trainer, "mint_unique_id", lambda: bytes(range(128)))
    monkeypatch.setattr(nccl_worker, "connect_nccl", nccl_worker.join_link)

    def packer(self: Any, device: int | None) -> HostPacker:
        return HostPacker(FakeP2PCupy(world, 0))

    from weightwire.trainer.framework import FrameworkHooks

    monkeypatch.setattr(FrameworkHooks, "device_packer", packer)
    for path in ("weightwire.jax_side.engine", "weightwire.torch_side.sender.engine"):
        try:
            module = __import__(path, fromlist=["x"])
        except ImportError:
            continue
        for obj in vars(module).values():
            if isinstance(obj, type) and "device_packer" in vars(obj):
                monkeypatch.setattr(obj, "device_packer", packer)
    yield world
