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

from tests.trainer.ipc_pull_worker import PullCupy, PullWorker, handle, pull_rendezvous
from tests.trainer.test_ipc_pipeline import FakePacker, _prepared
from weightwire.backends.base import Outgoing, SenderParts
from weightwire.backends.ipc.channel import Channel
from weightwire.backends.ipc.link import IPCSenderComm
from weightwire.backends.ipc.pull import IPCPullPipeline, WorkerBuffers
from weightwire.backends.ipc.slots import IPCSlots
from weightwire.backends.ipc.trainer import IPCBackend
from weightwire.shared.errors import PeerLost, TransferError
from weightwire.trainer import TrainerInitInfo


def _setup(
    sizes: list[int],
    *,
    release: bool = False,
    misbehave: str = "",
    ids: list[int] | None = None,
    cap: int = 0,
    early: dict[int, int] | None = None,
    start: bool = True,
):
    log: list = []
    cp = PullCupy(log)
    slots = IPCSlots(cp, 0, 100, 2)
    slots.free_memory()  # pull mode: the ring's buffers go at join, its ready events stay
    a, b = socket.socketpair()
    comm = IPCSenderComm(
        cp, slots, [Channel(a, "IPC worker rank 1")], [[11, 12]], [""], release, "pull"
    )
    worker = PullWorker(
        b, sizes, release=release, misbehave=misbehave, ids=ids, cap=cap, early=early
    )
    if start:
        worker.start()
    return (
        log,
        slots,
        worker,
        IPCPullPipeline(comm, FakePacker(), timeout=5.0),
    )


def test_chunks_go_straight_into_the_named_buffers() -> None:
    log, slots, worker, pipe = _setup([120, 110, 90])
    order: list[str] = []
    prepared = _prepared(
        [30, 90, 50, 60, 90], 100
    )  # chunks [t0 t1] = 120, [t2 t3] = 110, [t4] = 90
    assert (
        pipe.send(Outgoing(prepared, threading.Event(), begin=lambda: order.append("begin")))
    ) == (320, 3)
    worker.join(10)
    assert [(m["c"], m["e"]) for m in worker.seen] == [(0, 0), (1, 1), (2, 0)]
    b0, b1, b2 = 10_000 * 100, 10_000 * 101, 10_000 * 102
    e0, e1 = slots.events
    ops = [e for e in log if e[0] in ("copy", "wait", "record", "open")]
    assert ops == [
        ("open", 100),
        ("wait", 200),
        ("copy", b0, 1_000_000, 30),
        ("copy", b0 + 30, 2_000_000, 90),
        ("record", e0),
        ("open", 101),
        ("wait", 201),
        ("copy", b1, 3_000_000, 50),
        ("copy", b1 + 50, 4_000_000, 60),
        ("record", e1),
        ("open", 102),
        ("wait", 202),
        ("copy", b2, 5_000_000, 90),
        ("record", e0),
    ]
    assert pipe.held_bytes() == 0 and order == ["begin"]
    pipe.close()
    assert sorted(e[1] for e in log if e[0] == "close") == [
        b0,
        b1,
        b2,
    ]  # mappings closed once, at the end


def test_a_second_round_reuses_the_mappings() -> None:
    log, _, worker, pipe = _setup([60, 60], ids=[0, 1])
    pipe.send(Outgoing(_prepared([60, 60], 50), threading.Event()))
    worker.join(10)
    a, b = socket.socketpair()
    pipe._comm.channels[0] = Channel(a, "IPC worker rank 1")
    again = PullWorker(b, [60, 60], ids=[1, 0])
    again.named = {0, 1}  # the same session: the worker names known ids without handles
    again.start()
    pipe.send(Outgoing(_prepared([60, 60], 50), threading.Event()))
    again.join(10)
    assert [op for op, *_ in log if op == "open"] == ["open", "open"]  # round 2 opened nothing
    copies = [e[1] for e in log if e[0] == "copy"]
    assert copies[2:] == [
        10_000 * 101,
        10_000 * 100,
    ]  # chunk 0 into buffer 1 now, chunk 1 into buffer 0


def test_release_after_round_closes_every_mapping_before_unmapped() -> None:
    log, _, worker, pipe = _setup([60, 60], release=True)
    pipe.send(Outgoing(_prepared([60, 60], 50), threading.Event()))
    worker.join(10)
    assert worker.seen[-1]["op"] == "unmapped"
    assert sorted(e[1] for e in log if e[0] == "close") == [10_000 * 100, 10_000 * 101]
    assert pipe._buffers[0].mapped == {}


@pytest.mark.parametrize(
    ("misbehave", "needle"),
    [
        ("short", "wants 59 bytes for chunk 0 where the plan has 60"),
        ("nohandle", "named buffer 0 without its handles"),
        ("die", "IPC worker rank 1 closed the IPC control channel|lost IPC worker rank 1"),
    ],
)
def test_a_worker_out_of_step_is_refused_by_name(misbehave: str, needle: str) -> None:
    _, _, _, pipe = _setup([60, 60, 60], misbehave=misbehave)
    with pytest.raises(TransferError, match=needle) as err:
        pipe.send(Outgoing(_prepared([60, 60, 60], 50), threading.Event()))
    if misbehave == "die":
        assert isinstance(err.value, PeerLost)


def test_a_buffer_takes_a_larger_chunk_within_its_announced_capacity() -> None:
    # Chunk 2 (80 B) reuses buffer 0, first named for chunk 0 (60 B) with a capacity of 80.
    log, _, worker, pipe = _setup([60, 70, 80], ids=[0, 1, 0], cap=80)
    assert pipe.send(Outgoing(_prepared([60, 70, 80], 50), threading.Event())) == (210, 3)
    worker.join(10)
    assert [e[1:] for e in log if e[0] == "copy"][-1] == (10_000 * 100, 3_000_000, 80)


def test_a_chunk_over_the_buffers_capacity_is_refused() -> None:
    _, _, _, pipe = _setup([60, 70, 80], ids=[0, 1, 0])  # capacity = the first chunk's 60 B
    with pytest.raises(TransferError, match="named buffer 0 of 60 bytes for a chunk of 80"):
        pipe.send(Outgoing(_prepared([60, 70, 80], 50), threading.Event()))


def test_a_reannounced_buffer_is_refused() -> None:
    _, _, _, pipe = _setup([60, 60, 60], ids=[0, 1, 0], misbehave="reannounce")
    with pytest.raises(TransferError, match="announced buffer 0 again"):
        pipe.send(Outgoing(_prepared([60, 60, 60], 50), threading.Event()))


def test_a_wrong_chunk_and_a_silent_worker_are_bounded() -> None:
    log: list = []
    cp = PullCupy(log)
    bufs = WorkerBuffers(cp, 0, "IPC worker rank 1")
    with pytest.raises(TransferError, match="with b=-1, outside"):
        bufs.resolve({"op": "want", "c": 0, "b": -1, "n": 4}, 4)
    with pytest.raises(TransferError, match="want.h must be 88 base64 characters"):
        bufs.resolve(
            {"op": "want", "c": 0, "b": 0, "n": 4, "h": "AAAA", "f": handle(1), "cap": 4}, 4
        )
    with pytest.raises(TransferError, match="with cap=3, outside \\[4, "):
        bufs.resolve(
            {"op": "want", "c": 0, "b": 0, "n": 4, "h": handle(1), "f": handle(1), "cap": 3}, 4
        )
    slots = IPCSlots(cp, 0, 100, 2)
    a, _b = socket.socketpair()
    comm = IPCSenderComm(
        cp, slots, [Channel(a, "IPC worker rank 1")], [[11, 12]], [""], False, "pull"
    )
    pipe = IPCPullPipeline(comm, FakePacker(), timeout=0.2)
    start = time.monotonic()
    with pytest.raises(
        TransferError,
        match="the receive buffer of chunk 0 from IPC worker rank 1 did not arrive within",
    ):
        pipe.send(Outgoing(_prepared([60], 50), threading.Event()))
    assert time.monotonic() - start < 5


def test_a_refused_start_announces_nothing_and_unpacked_is_refused() -> None:
    _, _, worker, pipe = _setup([60])
    worker.gate.clear()  # no update POST, so the worker never names a buffer

    def begin() -> None:
        raise RuntimeError("start_weight_update failed: 409")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="409"):
        pipe.send(Outgoing(_prepared([60], 50), threading.Event(), begin))
    assert time.monotonic() - start < 2  # at once, not at the 5 s transfer timeout
    pipe._comm.abort()
    worker.join(10)
    assert worker.seen == []
    settings = TrainerInitInfo(backend="weightwire_ipc", packed=False)
    with pytest.raises(TransferError, match="packed rounds only"):
        IPCBackend().sender(pipe._comm, settings, SenderParts(lambda t: t, packer=pipe._packer))


def _join(monkeypatch: pytest.MonkeyPatch, *, packed: bool, mode: str, offer: list[str] | None):
    """A real rendezvous (fake CUDA) joined by one worker whose hello offers ``offer``."""
    from weightwire.backends.ipc.channel import dial
    from weightwire.backends.ipc.info import IPCInitInfo

    log: list = []
    rdv = pull_rendezvous(monkeypatch, mode, packed=packed, log=log)
    info = IPCInitInfo.from_dict(rdv.payload)  # the init info is the same whatever the mode
    got: list = []

    def worker() -> None:
        ch = dial(info.host, info.port, info.secret, timeout=5, peer="trainer")
        hello: dict[str, Any] = {
            "op": "hello",
            "rank": 1,
            "free": [handle(7), handle(8)],
            "uuid": "",
        }
        if offer is not None:
            hello["modes"] = offer
        ch.send(hello)
        with pytest.raises(TransferError):  # whatever came, then the trainer's end closed
            while True:
                got.append(ch.recv(deadline=time.monotonic() + 5, what="x"))

    thread = threading.Thread(target=worker)
    thread.start()
    comm = rdv.join(timeout=5)
    comm.close()
    thread.join(10)
    return comm, rdv, got


@pytest.mark.parametrize(
    ("packed", "mode", "offer", "want", "told"),
    [
        (True, "pull", ["pull", "push"], "pull", [{"op": "mode", "mode": "pull", "early": True}]),
        (True, "pull", ["push", "later-mode"], "push", [{"op": "mode", "mode": "push"}]),
        (False, "pull", ["push"], "push", [{"op": "mode", "mode": "push"}]),  # unpacked: push
        (True, "push", ["pull", "push"], "push", [{"op": "mode", "mode": "push"}]),
    ],
)
def test_the_hello_negotiates_the_mode(
    monkeypatch: pytest.MonkeyPatch,
    packed: bool,
    mode: str,
    offer: list[str] | None,
    want: str,
    told: list[dict],
) -> None:
    comm, rdv, got = _join(monkeypatch, packed=packed, mode=mode, offer=offer)
    assert comm.mode == want and got == told
    assert rdv.slots.allocated == (
        want == "push"
    )  # pull frees the ring at once; its ready events stay
    assert len(rdv.slots.events) == 2


@pytest.mark.parametrize("offer", ["pull", None, []])
def test_a_malformed_or_missing_mode_offer_is_refused(
    monkeypatch: pytest.MonkeyPatch, offer: object
) -> None:
    with pytest.raises(TransferError, match="hello.modes"):
        _join(monkeypatch, packed=True, mode="pull", offer=offer)  # type: ignore[arg-type]


# -- early wants: buffers named at the round's start ----------------------------------------


def test_early_buffers_are_filled_before_the_start_returned_and_need_no_want() -> None:
    log, slots, worker, pipe = _setup([60, 60], ids=[4, 5], early={0: 60, 1: 60})
    worker.gate.clear()  # the update POST (which would bring wants) is not out yet
    copied = threading.Event()
    rt = pipe._comm.cp.cuda.runtime
    plain = rt.memcpyAsync
    rt.memcpyAsync = lambda *a: (plain(*a), copied.set())

    def begin() -> None:  # the start: its reply is only back once chunk 0 is in the early buffer
        worker.started.set()
        assert copied.wait(5), "the trainer waited for the start before filling an early buffer"
        worker.gate.set()

    assert pipe.send(Outgoing(_prepared([60, 60], 50), threading.Event(), begin)) == (120, 2)
    worker.join(10)
    assert [(m["c"], m["e"]) for m in worker.seen] == [(0, 0), (1, 1)]
    assert [e[1] for e in log if e[0] == "copy"] == [10_000 * 104, 10_000 * 105]
    assert [e[1] for e in log if e[0] == "open"] == [104, 105]


def test_an_early_buffer_named_for_another_size_is_skipped_for_the_chunks_want() -> None:
    # The plan changed (chunk 0 is 60 B now, named early for 50): both sides drop it.
    log, _, worker, pipe = _setup([60, 60], ids=[0, 1], early={0: 50, 1: 60})
    worker.early_ids, worker.ids = [0, 1], [7, 1]  # the want for chunk 0 names another buffer
    out = Outgoing(_prepared([60, 60], 50), threading.Event(), worker.started.set)
    assert pipe.send(out) == (120, 2)
    worker.join(10)
    assert [e[1] for e in log if e[0] == "copy"] == [10_000 * 107, 10_000 * 101]


def test_early_wants_left_from_an_earlier_round_are_void() -> None:
    log, _, worker, pipe = _setup([60], ids=[3], start=False)
    worker.ch.send(
        {
            "op": "early",
            "wants": [{"c": 0, "n": 60, "b": 9, "h": handle(109), "f": handle(209), "cap": 60}],
        }
    )
    worker.start()  # this round's worker names buffer 3 on demand
    pipe.send(Outgoing(_prepared([60], 50), threading.Event()))
    worker.join(10)
    assert [e[1] for e in log if e[0] == "copy"] == [10_000 * 103]  # never into the stale buffer 9


@pytest.mark.parametrize(
    ("wants", "needle"),
    [
        ([], "without 1..2 wants"),
        ([{"c": 2, "n": 60, "b": 0}], "with c=2, outside \\[0, 1\\]"),
        ([{"c": 0, "n": 60, "b": 0}, {"c": 0, "n": 60, "b": 1}], "named chunk 0 twice"),
        ([{"c": 0, "n": 0, "b": 0}], "with n=0, outside"),
    ],
)
def test_a_malformed_early_message_is_refused(wants: list, needle: str) -> None:
    _, _, worker, pipe = _setup([60], start=False)

    def begin() -> None:  # the worker's start sends it
        worker.ch.send({"op": "early", "wants": wants})

    with pytest.raises(TransferError, match=needle):
        pipe.send(Outgoing(_prepared([60], 50), threading.Event(), begin))
