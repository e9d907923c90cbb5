"""``IPCPipeline`` (rank 0 of ``weightwire_ipc``) on CPU, with a fake CUDA runtime and a
fake worker on the other end of a real control channel.

What is checked is the protocol, not CUDA: how chunks are cut into slot-sized pieces
(a tensor crossing a slot edge is split, a chunk never shares a slot with the next),
that a slot is refilled only after its release arrived and the fill stream waits on
the worker's free event, that no piece is announced before the control plane's
``begin`` returned, release-after-round, and the failure paths (a release out of
order, a dead worker, a refused start).
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import nullcontext
from typing import Any

import pytest

from weightwire.backends.base import Outgoing
from weightwire.backends.device import DeviceBytes
from weightwire.backends.ipc.channel import Channel
from weightwire.backends.ipc.link import IPCSenderComm
from weightwire.backends.ipc.pipeline import IPCPipeline
from weightwire.backends.ipc.slots import IPCSlots
from weightwire.shared.errors import PeerLost, TransferError
from weightwire.shared.framing import plan
from weightwire.shared.meta import ParamMeta


class FakeRuntime:
    CUDARuntimeError = RuntimeError

    def __init__(self, log: list) -> None:
        self.log, self._next = log, 1000

    def _new(self) -> int:
        self._next += 1000
        return self._next

    def eventCreateWithFlags(self, flags: int) -> int:  # CUDA's names
        return self._new()

    def malloc(self, n: int) -> int:
        ptr = self._new() * 1000
        self.log.append(("malloc", ptr, n))
        return ptr

    def free(self, ptr: int) -> None:
        self.log.append(("free", ptr))

    def eventDestroy(self, e: int) -> None:
        pass

    def ipcGetMemHandle(self, ptr: int) -> bytes:
        return ptr.to_bytes(8, "little") * 8

    def ipcGetEventHandle(self, e: int) -> bytes:
        return e.to_bytes(8, "little") * 8

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        self.log.append(("copy", dst, src, n))

    def eventRecord(self, event: int, stream: int) -> None:
        self.log.append(("record", event))

    def streamWaitEvent(self, stream: int, event: int, flags: int) -> None:
        self.log.append(("wait", event))

    def eventQuery(self, event: int) -> int:
        return 0  # done: the fakes' device work completes as it is enqueued

    def getDeviceProperties(self, i: int) -> dict:
        return {"uuid": b"\x01" * 16}


class FakeEvent:
    done = True

    def __init__(self, **_: Any) -> None:
        pass

    def record(self, stream: Any) -> None:
        pass


class FakeCupy:
    def __init__(self, log: list) -> None:
        cuda = type("cuda", (), {})()
        cuda.runtime = FakeRuntime(log)
        cuda.Device = lambda i: nullcontext()
        cuda.Event = FakeEvent
        cuda.ExternalStream = lambda ptr, dev=None: ptr
        self.cuda = cuda


class FakePacker:
    def new_stream(self) -> Any:
        return type("S", (), {"ptr": 7})()

    def regions(self, tensors: list, stream: Any) -> list[DeviceBytes]:
        return [DeviceBytes(ptr, n, 0, None) for ptr, n in tensors]

    def release(self) -> None:
        pass


class FakeWorker(threading.Thread):
    """Reads announcements and answers each with a release; ``misbehave`` bends that."""

    def __init__(
        self, conn: Any, total: int, *, release: bool = False, misbehave: str = ""
    ) -> None:
        super().__init__(daemon=True)
        self.ch, self.total, self.release, self.misbehave = (
            Channel(conn, "trainer"),
            total,
            release,
            misbehave,
        )
        self.seen: list[dict] = []
        self.log: list[str] | None = None

    def run(self) -> None:
        try:
            self._serve()
        except TransferError:  # the trainer side gave up first: nothing left to answer
            return

    def _serve(self) -> None:
        import time

        got = 0
        while got < self.total:
            try:
                msg = self.ch.recv(deadline=time.monotonic() + 10, what="x")
            except TransferError:
                return
            self.seen.append(msg)
            if self.log is not None:
                self.log.append(msg["op"])
            if msg["op"] != "ready":
                continue
            got += msg["n"]
            if self.misbehave == "die":
                self.ch.abort()
                return
            slot = (msg["s"] + 1) % 2 if self.misbehave == "wrong_slot" else msg["s"]
            self.ch.send({"op": "free", "s": slot})
        if self.release:
            self.ch.send({"op": "closed"})


def _setup(
    total: int, *, slot: int = 100, count: int = 2, release: bool = False, misbehave: str = ""
):
    log: list = []
    cp = FakeCupy(log)
    slots = IPCSlots(cp, 0, slot, count)
    a, b = socket.socketpair()
    comm = IPCSenderComm(
        cp, slots, [Channel(a, "IPC worker rank 1")], [[11, 12][:count]], [""], release
    )
    worker = FakeWorker(b, total, release=release, misbehave=misbehave)
    worker.start()
    pipe = IPCPipeline(comm, FakePacker(), timeout=10.0)
    return log, slots, worker, pipe


def _prepared(sizes: list[int], buffer: int, packed: bool = True):
    metas = [ParamMeta(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    tensors = [(1_000_000 * (i + 1), n) for i, n in enumerate(sizes)]
    chunks = plan(metas, packed=packed, buffer_size_bytes=buffer)
    return [(c, tensors[c.start : c.stop]) for c in chunks]


def test_pieces_split_tensors_at_slot_edges_and_wait_for_releases() -> None:
    log, slots, worker, pipe = _setup(180)
    order: list[str] = []
    worker.log = order
    prepared = _prepared([30, 90, 50, 10], 100)  # chunks [t0 t1] = 120 B, [t2 t3] = 60 B
    nbytes, pieces = pipe.send(
        Outgoing(prepared, threading.Event(), begin=lambda: order.append("begin"))
    )
    worker.join(10)
    assert (nbytes, pieces) == (180, 3)
    ready = [{k: m[k] for k in ("c", "s", "o", "n")} for m in worker.seen]
    assert ready == [
        {"c": 0, "s": 0, "o": 0, "n": 100},
        {"c": 0, "s": 1, "o": 100, "n": 20},
        {"c": 1, "s": 0, "o": 0, "n": 60},
    ]
    s0, s1 = slots.ptrs
    ops = [e for e in log if e[0] in ("copy", "wait", "record")]
    e0, e1 = slots.events
    assert ops == [
        ("copy", s0, 1_000_000, 30),
        ("copy", s0 + 30, 2_000_000, 70),
        ("record", e0),
        ("copy", s1, 2_000_070, 20),
        ("record", e1),
        ("wait", 11),  # slot 0 is refilled only after the worker's free event for it
        ("copy", s0, 3_000_000, 50),
        ("copy", s0 + 50, 4_000_000, 10),
        ("record", e0),
        ("wait", 12),
        ("wait", 11),  # end of round: the last releases, oldest first
    ]
    assert order[0] == "begin"  # nothing announced before the control plane ran
    pipe.close()
    assert not slots.allocated


def test_release_after_round_frees_slots_and_announces_new_ones() -> None:
    log, slots, worker, pipe = _setup(50, release=True)
    first = list(slots.ptrs)
    pipe.send(Outgoing(_prepared([50], 100), threading.Event()))
    worker.join(10)
    assert not slots.allocated and pipe.held_bytes() == 0
    assert [("free", p) for p in first] == [
        e for e in log if e[0] == "free"
    ]  # only after the worker's "closed"
    # The next round of the same session: fresh buffers, announced before its first piece.
    a, b = socket.socketpair()
    pipe._comm.channels[0] = Channel(a, "IPC worker rank 1")
    second = FakeWorker(b, 50, release=True)
    second.start()
    pipe.send(Outgoing(_prepared([50], 100), threading.Event()))
    second.join(10)
    assert [m["op"] for m in second.seen] == ["slots", "ready"]
    assert len(second.seen[0]["mem"]) == 2 and not slots.allocated


def test_release_after_round_a_round_of_no_tensors_waits_for_no_close() -> None:
    """A round of no tensors has no chunk: the worker's push link never reaches the last
    chunk where it closes its slot mappings and says "closed" (it never mapped them: they are
    announced with a round's first piece). The trainer neither waits for that word (was: until
    its transfer timeout, then ``TransferTimeout``) nor keeps the slots it made for the round;
    the next round announces fresh ones. (The engine sends no round of no tensors,
    ``tests/faults/test_api_misuse.py``: this is the data path's own rule.)"""
    log, slots, _, pipe = _setup(0, release=True)  # a worker that says nothing, as a real one
    a, b = socket.socketpair()
    pipe._comm.channels[0] = Channel(a, "IPC worker rank 1")
    t0 = time.monotonic()
    assert pipe.send(Outgoing([], threading.Event())) == (0, 0)
    assert time.monotonic() - t0 < 2.0
    assert not slots.allocated and pipe.held_bytes() == 0
    worker = FakeWorker(b, 50, release=True)
    worker.start()
    pipe.send(Outgoing(_prepared([50], 100), threading.Event()))
    worker.join(10)
    assert [m["op"] for m in worker.seen] == ["slots", "ready"] and not slots.allocated


def test_a_release_out_of_order_is_refused_by_name() -> None:
    _, _, _, pipe = _setup(300, misbehave="wrong_slot")
    with pytest.raises(TransferError, match="released IPC slot 1 where slot 0 was due"):
        pipe.send(Outgoing(_prepared([100, 100, 100], 99), threading.Event()))


def test_a_dead_worker_is_peer_lost_not_a_hang() -> None:
    _, _, _, pipe = _setup(300, misbehave="die")
    # Seen on the next send (broken pipe) or the next wait (EOF): either way named, at once.
    with pytest.raises(
        PeerLost,
        match="lost IPC worker rank 1 while|IPC worker rank 1 closed the IPC control channel",
    ):
        pipe.send(Outgoing(_prepared([100, 100, 100], 99), threading.Event()))


def test_a_refused_start_announces_nothing() -> None:
    _, _, worker, pipe = _setup(100)

    def begin() -> None:
        raise RuntimeError("start_weight_update failed: 409 a round is already active")

    with pytest.raises(RuntimeError, match="409 a round is already active"):
        pipe.send(Outgoing(_prepared([100], 200), threading.Event(), begin))
    pipe._comm.abort()
    worker.join(10)
    assert worker.seen == []


def test_unpacked_rounds_take_one_piece_per_tensor() -> None:
    _, _, worker, pipe = _setup(60)
    nbytes, pieces = pipe.send(
        Outgoing(_prepared([10, 20, 30], 100, packed=False), threading.Event())
    )
    worker.join(10)
    assert (nbytes, pieces) == (60, 3)
    assert [(m["c"], m["s"], m["n"]) for m in worker.seen] == [(0, 0, 10), (1, 1, 20), (2, 0, 30)]
