"""Pull mode of ``weightwire_ipc`` on CPU: ``IPCPullPipeline`` (the trainer writes into the
worker's buffers) against a fake worker on a real control channel, with a fake CUDA runtime.

Checked: one "want" / one "ready" per chunk, the tensors copied straight into the named
buffer (one copy per tensor, after a device wait on that buffer's free event, the
ready event recorded after them and before the message), handles opened once per
session and never again, release-after-round closing every mapping before
"unmapped", and the failure paths (a plan mismatch, a re-announced or unannounced
buffer, a dead worker, a refused start, an unpacked round).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from tests.trainer.test_ipc_pipeline import FakeCupy, FakePacker, _prepared
from weightwire.backends.ipc.channel import Channel
from weightwire.backends.ipc.pull import IPCPullPipeline, WorkerBuffers
from weightwire.backends.ipc.slots import IPCSlots
from weightwire.backends.ipc.trainer import IPCSenderComm
from weightwire.shared.communicator import PeerLost, TransferError
from weightwire.shared.info import encode_secret
from weightwire.shared.meta import ParamMeta


def handle(n: int) -> str:
    return encode_secret(n.to_bytes(8, "little") * 8)


class PullWorker(threading.Thread):
    """Names buffer ``ids[c]`` for chunk ``c`` (handles on first use), reads each "ready"."""

    def __init__(self, conn: Any, sizes: list[int], *, ids: list[int] | None = None, depth: int = 2,
                 release: bool = False, misbehave: str = "") -> None:
        super().__init__(daemon=True)
        self.gate = threading.Event()  # set by the round's begin: a real worker names nothing before the update POST
        self.gate.set()
        self.ch, self.sizes, self.depth, self.release, self.misbehave = Channel(conn, "trainer"), sizes, depth, release, misbehave
        self.ids = ids if ids is not None else list(range(len(sizes)))
        self.named: set[int] = set()
        self.seen: list[dict] = []

    def want(self, c: int) -> None:
        bid = self.ids[c]
        msg: dict[str, Any] = {"op": "want", "c": c, "b": bid, "n": self.sizes[c]}
        if bid not in self.named or self.misbehave == "reannounce":
            msg.update(h=handle(100 + bid), f=handle(200 + bid))
            self.named.add(bid)
        if self.misbehave == "short":
            msg["n"] -= 1
        if self.misbehave == "nohandle":
            msg.pop("h", None)
        if self.misbehave == "die" and c == 1:
            self.ch.abort()
            return
        self.ch.send(msg)

    def run(self) -> None:
        try:
            while not self.gate.wait(0.05):
                if self.ch._aborted:
                    return
            posted = 0
            for c in range(len(self.sizes)):
                while posted < len(self.sizes) and posted < c + self.depth:
                    self.want(posted)
                    posted += 1
                self.seen.append(self.ch.expect("ready", deadline=time.monotonic() + 10, what="ready"))
            if self.release:
                self.seen.append(self.ch.expect("unmapped", deadline=time.monotonic() + 10, what="unmapped"))
        except TransferError:
            return


class PullCupy(FakeCupy):
    def __init__(self, log: list) -> None:
        super().__init__(log)
        rt = self.cuda.runtime
        rt.ipcOpenMemHandle = lambda h, flags: log.append(("open", int.from_bytes(h[:8], "little"))) or 10_000 * int.from_bytes(h[:8], "little")
        rt.ipcCloseMemHandle = lambda p: log.append(("close", p))
        rt.ipcOpenEventHandle = lambda h: int.from_bytes(h[:8], "little")


def _setup(sizes: list[int], *, release: bool = False, misbehave: str = "", ids: list[int] | None = None):
    log: list = []
    cp = PullCupy(log)
    slots = IPCSlots(cp, 0, 100, 2)
    slots.free_memory()  # pull mode: the ring's buffers go at join, its ready events stay
    a, b = socket.socketpair()
    comm = IPCSenderComm(cp, slots, [Channel(a, "IPC worker rank 1")], [[11, 12]], [""], release, "pull")
    worker = PullWorker(b, sizes, release=release, misbehave=misbehave, ids=ids)
    worker.start()
    return log, slots, worker, IPCPullPipeline(comm, FakePacker(), num_buffers=2, timeout=5.0, hold_bytes=0)


def test_chunks_go_straight_into_the_named_buffers() -> None:
    log, slots, worker, pipe = _setup([120, 110, 90])
    order: list[str] = []
    prepared = _prepared([30, 90, 50, 60, 90], 100)  # chunks [t0 t1] = 120, [t2 t3] = 110, [t4] = 90
    assert (pipe.send_packed(prepared, threading.Event(), begin=lambda: order.append("begin"))) == (320, 3)
    worker.join(10)
    assert [(m["c"], m["e"]) for m in worker.seen] == [(0, 0), (1, 1), (2, 0)]
    b0, b1, b2 = 10_000 * 100, 10_000 * 101, 10_000 * 102
    e0, e1 = slots.events
    ops = [e for e in log if e[0] in ("copy", "wait", "record", "open")]
    assert ops == [
        ("open", 100), ("wait", 200), ("copy", b0, 1_000_000, 30), ("copy", b0 + 30, 2_000_000, 90), ("record", e0),
        ("open", 101), ("wait", 201), ("copy", b1, 3_000_000, 50), ("copy", b1 + 50, 4_000_000, 60), ("record", e1),
        ("open", 102), ("wait", 202), ("copy", b2, 5_000_000, 90), ("record", e0),
    ]
    assert pipe.held_bytes() == 0 and order == ["begin"]
    pipe.close()
    assert sorted(e[1] for e in log if e[0] == "close") == [b0, b1, b2]  # mappings closed once, at the end


def test_a_second_round_reuses_the_mappings() -> None:
    log, _, worker, pipe = _setup([60, 60], ids=[0, 1])
    pipe.send_packed(_prepared([60, 60], 50), threading.Event())
    worker.join(10)
    a, b = socket.socketpair()
    pipe._comm.channels[0] = Channel(a, "IPC worker rank 1")
    again = PullWorker(b, [60, 60], ids=[1, 0])
    again.named = {0, 1}  # the same session: the worker names known ids without handles
    again.start()
    pipe.send_packed(_prepared([60, 60], 50), threading.Event())
    again.join(10)
    assert [op for op, *_ in log if op == "open"] == ["open", "open"]  # round 2 opened nothing
    copies = [e[1] for e in log if e[0] == "copy"]
    assert copies[2:] == [10_000 * 101, 10_000 * 100]  # chunk 0 into buffer 1 now, chunk 1 into buffer 0


def test_release_after_round_closes_every_mapping_before_unmapped() -> None:
    log, _, worker, pipe = _setup([60, 60], release=True)
    pipe.send_packed(_prepared([60, 60], 50), threading.Event())
    worker.join(10)
    assert worker.seen[-1]["op"] == "unmapped"
    assert sorted(e[1] for e in log if e[0] == "close") == [10_000 * 100, 10_000 * 101]
    assert pipe._buffers[0].mapped == {}


@pytest.mark.parametrize(("misbehave", "needle"), [
    ("short", "wants 59 bytes for chunk 0 where the plan has 60"),
    ("nohandle", "named buffer 0 without its handles"),
    ("die", "IPC worker rank 1 closed the IPC control channel|lost IPC worker rank 1"),
])
def test_a_worker_out_of_step_is_refused_by_name(misbehave: str, needle: str) -> None:
    _, _, _, pipe = _setup([60, 60, 60], misbehave=misbehave)
    with pytest.raises(TransferError, match=needle) as err:
        pipe.send_packed(_prepared([60, 60, 60], 50), threading.Event())
    if misbehave == "die":
        assert isinstance(err.value, PeerLost)


def test_a_reannounced_buffer_is_refused() -> None:
    _, _, _, pipe = _setup([60, 60, 60], ids=[0, 1, 0], misbehave="reannounce")
    with pytest.raises(TransferError, match="announced buffer 0 again"):
        pipe.send_packed(_prepared([60, 60, 60], 50), threading.Event())


def test_a_wrong_chunk_and_a_silent_worker_are_bounded() -> None:
    log: list = []
    cp = PullCupy(log)
    bufs = WorkerBuffers(cp, 0, "IPC worker rank 1")
    with pytest.raises(TransferError, match="with b=-1, outside"):
        bufs.resolve({"op": "want", "c": 0, "b": -1, "n": 4}, 4)
    with pytest.raises(TransferError, match="want.h must be 88 base64 characters"):
        bufs.resolve({"op": "want", "c": 0, "b": 0, "n": 4, "h": "AAAA", "f": handle(1)}, 4)
    slots = IPCSlots(cp, 0, 100, 2)
    a, _b = socket.socketpair()
    comm = IPCSenderComm(cp, slots, [Channel(a, "IPC worker rank 1")], [[11, 12]], [""], False, "pull")
    pipe = IPCPullPipeline(comm, FakePacker(), num_buffers=2, timeout=0.2, hold_bytes=0)
    start = time.monotonic()
    with pytest.raises(TransferError, match="no the receive buffer of chunk 0 from IPC worker rank 1 within"):
        pipe.send_packed(_prepared([60], 50), threading.Event())
    assert time.monotonic() - start < 5


def test_a_refused_start_announces_nothing_and_unpacked_is_refused() -> None:
    _, _, worker, pipe = _setup([60])
    worker.gate.clear()  # no update POST, so the worker never names a buffer

    def begin() -> None:
        raise RuntimeError("start_weight_update failed: 409")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="409"):
        pipe.send_packed(_prepared([60], 50), threading.Event(), begin)
    assert time.monotonic() - start < 2  # at once, not at the 5 s transfer timeout
    pipe._comm.abort()
    worker.join(10)
    assert worker.seen == []
    with pytest.raises(TransferError, match="packed rounds only"):
        pipe.send_unpacked([], [ParamMeta("t", "uint8", (1,))], threading.Event())
