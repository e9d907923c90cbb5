"""The worker's end of pull mode on CPU: ``connect_ipc`` against a scripted trainer on a
real control channel, with a fake CUDA runtime and torch's CUDA calls stubbed.

Checked: the hello offers both modes (push only for an unpacked session), the session's
mode is taken from the trainer's answer (a trainer that names none is refused), and
``IPCPullLink`` names a pool buffer per chunk (handles once), waits on the ready event the
trainer names, hands the buffer to torch as a lease, frees the pool only after "unmapped"
with release-after-round, refuses a round out of step by name, and reports a dead trainer
as ``PeerLost`` without freeing a buffer the trainer may still be writing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from tests.backends.ipc_worker_fakes import Cupy, connect_scripted
from weightwire.backends.ipc import worker as ipc_worker
from weightwire.backends.ipc.channel import Channel
from weightwire.backends.worker_base import ReceiveTurn
from weightwire.shared.errors import PeerLost, TransferError
from weightwire.shared.framing import plan
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker.receive import UnpackPlan


@pytest.fixture
def cp(monkeypatch: pytest.MonkeyPatch) -> Cupy:
    fake = Cupy()
    monkeypatch.setattr(ipc_worker, "cupy_module", lambda: fake)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 77})()
    )
    leases: list = []

    def as_tensor(
        obj: Any, device: Any = None
    ) -> Any:  # keeps the lease, as torch's CAI tensor does
        leases.append(obj)
        return obj

    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    fake.leases = leases  # type: ignore[attr-defined]
    return fake


def _pull(ch: Channel, hello: dict) -> None:
    ch.send({"op": "mode", "mode": "pull"})
    ch.send({"op": "ping"})
    ch.expect("pong", deadline=time.monotonic() + 5, what="pong")


def _post(link: Any, index: int, chunk: Any, metas: list[ParamMeta]) -> None:
    """Post ``chunk`` as the round's chunk ``index``."""
    link.post(index, ReceiveTurn(0, metas, [chunk] * (index + 1), [], packed=True))


def _round(sizes: list[int]) -> tuple[list[ParamMeta], list]:
    metas = [ParamMeta(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
    return metas, plan(metas, packed=True, buffer_size_bytes=50)


def test_pull_link_names_buffers_and_hands_them_on_after_the_ready_event(cp: Cupy) -> None:
    link, ch, hello = connect_scripted(_pull)
    assert hello["modes"] == ["pull", "push"] and isinstance(link, ipc_worker.IPCPullLink)
    assert ("open_slot",) not in cp.cuda.runtime.log  # pull: the trainer's slots are never mapped
    metas, chunks = _round([60, 70])
    _post(link, 0, chunks[0], metas)
    _post(link, 1, chunks[1], metas)
    deadline = time.monotonic() + 5
    w0, w1 = (ch.expect("want", deadline=deadline, what="want") for _ in range(2))
    assert (w0["c"], w0["n"], w1["c"], w1["n"]) == (0, 60, 1, 70) and {"h", "f", "cap"} <= set(w0)
    assert w0["cap"] >= 60 and w0["b"] != w1["b"]
    ch.send({"op": "ready", "c": 0, "e": 1})
    lease = link.wait(0)
    assert (
        "wait",
        77,
        1002,
    ) in cp.cuda.runtime.log  # torch's current stream waits on ready event 1
    assert lease.__cuda_array_interface__["shape"] == (60,)
    # Once torch let chunk 0 go, its buffer serves the next chunk: named again without handles.
    cp.leases.clear()  # type: ignore[attr-defined]
    del lease
    _post(link, 2, chunks[0], metas)
    again = ch.expect("want", deadline=deadline, what="want")
    assert again["b"] == w0["b"] and "h" not in again and "cap" not in again
    assert len([e for e in cp.cuda.runtime.log if e[0] == "malloc"]) == 2
    link.close()


def test_an_unpacked_session_offers_push_only_and_opens_the_slots(
    cp: Cupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list = []
    monkeypatch.setattr(ipc_worker, "IPCLink", lambda rx, **kw: made.append(rx) or rx)

    def push(ch: Channel, hello: dict) -> None:
        ch.send({"op": "mode", "mode": "push"})
        ch.send({"op": "ping"})
        ch.expect("pong", deadline=time.monotonic() + 5, what="pong")

    rx, _, hello = connect_scripted(push, packed=False)
    assert hello["modes"] == ["push"] and made == [rx]
    assert (
        "open_slot",
    ) in cp.cuda.runtime.log  # push: the slots are opened once the mode is known
    rx.close()


def test_a_trainer_that_names_no_mode_is_refused(cp: Cupy) -> None:
    def modeless(ch: Channel, hello: dict) -> None:
        ch.send({"op": "ping"})  # the warm-up where the session's mode was due
        with pytest.raises(TransferError):
            ch.recv(deadline=time.monotonic() + 5, what="x")

    refused = r"sent 'ping' where the session's mode \('mode'\) was due"
    with pytest.raises(TransferError, match=refused):
        connect_scripted(modeless)


def test_a_mode_the_worker_did_not_offer_is_refused(cp: Cupy) -> None:
    def pushy(ch: Channel, hello: dict) -> None:
        ch.send({"op": "mode", "mode": "pull"})  # but the session is unpacked
        with pytest.raises(TransferError):
            ch.recv(deadline=time.monotonic() + 5, what="x")

    with pytest.raises(
        TransferError, match="chose IPC mode 'pull', which this worker did not offer"
    ):
        connect_scripted(pushy, packed=False)


def test_release_after_round_frees_the_pool_only_after_unmapped(cp: Cupy) -> None:
    link, ch, _ = connect_scripted(_pull, release=True)
    metas, chunks = _round([60])
    _post(link, 0, chunks[0], metas)
    ch.expect("want", deadline=time.monotonic() + 5, what="want")
    ch.send({"op": "ready", "c": 0, "e": 0})
    ch.send({"op": "unmapped"})
    link.wait(0)
    assert not [e for e in cp.cuda.runtime.log if e[0] == "free"]  # torch still holds the chunk
    cp.leases.clear()  # type: ignore[attr-defined]  # the round is loaded: the lease dies, the buffer goes
    assert [e[0] for e in cp.cuda.runtime.log if e[0] == "free"] == [
        "free"
    ] and link.held_bytes() == 0
    link.close()


def test_out_of_step_and_dead_trainers_are_named_and_in_flight_buffers_stay(cp: Cupy) -> None:
    link, ch, _ = connect_scripted(_pull)
    metas, chunks = _round([60, 70])
    _post(link, 0, chunks[0], metas)
    _post(link, 1, chunks[1], metas)
    ch.send({"op": "ready", "c": 1, "e": 0})
    with pytest.raises(TransferError, match="announced chunk 1 where chunk 0 was due"):
        link.wait(0)
    link2, ch2, _ = connect_scripted(_pull)
    _post(link2, 0, chunks[0], metas)
    ch2.abort()  # the trainer dies mid-round
    with pytest.raises(
        PeerLost, match="closed the IPC control channel while this side waited for chunk 0"
    ):
        link2.wait(0)
    link2.abort()
    assert not [
        e for e in cp.cuda.runtime.log if e[0] == "free"
    ]  # the trainer may still be writing them
    link.abort()


# -- early wants: the round's first buffers named at its start ----------------------------


def _pull_early(ch: Channel, hello: dict) -> None:
    ch.send({"op": "mode", "mode": "pull", "early": True})
    ch.send({"op": "ping"})
    ch.expect("pong", deadline=time.monotonic() + 5, what="pong")


def _one_round(link: Any, ch: Channel, chunks: list, metas: list, *, wants: int) -> list[dict]:
    """Post and load every chunk (readies sent at once); returns the wants the trainer saw."""
    deadline = time.monotonic() + 5
    for i, chunk in enumerate(chunks):
        _post(link, i, chunk, metas)
    got = [ch.expect("want", deadline=deadline, what="want") for _ in range(wants)]
    for i in range(len(chunks)):
        ch.send({"op": "ready", "c": i, "e": i % 2})
        link.wait(i)
    return got


def test_round_start_names_the_last_rounds_buffers_early_and_post_then_asks_nothing(
    cp: Cupy,
) -> None:
    link, ch, _ = connect_scripted(_pull_early)
    metas, chunks = _round([60, 70])
    first = _one_round(link, ch, chunks, metas, wants=2)
    cp.leases.clear()  # type: ignore[attr-defined]  # round 1 loaded: its buffers are free again
    link.start_round()
    early = ch.expect("early", deadline=time.monotonic() + 5, what="early")
    assert [(w["c"], w["n"], w["b"]) for w in early["wants"]] == [
        (0, 60, first[0]["b"]),
        (1, 70, first[1]["b"]),
    ]
    assert not any("h" in w for w in early["wants"])  # known to the trainer since round 1
    _one_round(link, ch, chunks, metas, wants=0)
    assert ch.discard_delivered("want") == 0  # round 2 asked for nothing
    assert len([e for e in cp.cuda.runtime.log if e[0] == "malloc"]) == 2
    link.close()


def test_an_early_buffer_of_another_size_goes_back_and_the_chunk_is_asked_for(cp: Cupy) -> None:
    link, ch, _ = connect_scripted(_pull_early)
    metas, chunks = _round([60, 70])
    first = _one_round(link, ch, chunks, metas, wants=2)
    cp.leases.clear()  # type: ignore[attr-defined]
    link.start_round()
    ch.expect("early", deadline=time.monotonic() + 5, what="early")
    metas2, chunks2 = _round([66])  # the plan changed: one chunk of 66 B
    (want,) = _one_round(link, ch, chunks2, metas2, wants=1)
    # 66 B shares chunk 0's size class: the early buffer went back to the pool and is named again.
    assert (want["c"], want["n"], want["b"]) == (0, 66, first[0]["b"])
    assert len([e for e in cp.cuda.runtime.log if e[0] == "malloc"]) == 2
    cp.leases.clear()  # type: ignore[attr-defined]
    assert (
        link.pool._buffers[first[1]["b"]].state == "free"
    )  # chunk 1's early buffer was let go at the end
    link.close()


def test_a_buffer_still_leased_is_not_named_early_and_nothing_is_allocated(cp: Cupy) -> None:
    link, ch, _ = connect_scripted(_pull_early)
    metas, chunks = _round([60])
    _one_round(link, ch, chunks, metas, wants=1)  # torch still holds chunk 0 (cp.leases)
    link.start_round()
    assert ch.discard_delivered("early") == 0
    assert len([e for e in cp.cuda.runtime.log if e[0] == "malloc"]) == 1
    link.close()


def test_a_trainer_that_did_not_offer_early_wants_gets_none(cp: Cupy) -> None:
    link, ch, _ = connect_scripted(_pull)
    metas, chunks = _round([60])
    _one_round(link, ch, chunks, metas, wants=1)
    cp.leases.clear()  # type: ignore[attr-defined]
    link.start_round()
    _one_round(link, ch, chunks, metas, wants=1)  # asked for on demand, as before
    link.close()


# -- views made before the ready message ------------------------------------------------------


def _real_tensors(cp: Cupy, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.as_tensor(lease)`` as a CPU uint8 tensor of the lease's size (the lease kept)."""

    def as_tensor(obj: Any, device: Any = None) -> torch.Tensor:
        cp.leases.append(obj)  # type: ignore[attr-defined]
        return torch.zeros(obj.__cuda_array_interface__["shape"][0], dtype=torch.uint8)

    monkeypatch.setattr(torch, "as_tensor", as_tensor)


def _logged_unpack(cp: Cupy, monkeypatch: pytest.MonkeyPatch) -> None:
    real = UnpackPlan.unpack

    def unpack(self: UnpackPlan, buffer: torch.Tensor) -> list:
        cp.cuda.runtime.log.append(("unpack",))
        return real(self, buffer)

    monkeypatch.setattr(UnpackPlan, "unpack", unpack)


def test_views_are_made_before_the_ready_and_the_buffer_leased_after_it(
    cp: Cupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    _real_tensors(cp, monkeypatch)
    _logged_unpack(cp, monkeypatch)
    link, ch, _ = connect_scripted(_pull)
    metas = [ParamMeta("a", "bfloat16", (3, 4)), ParamMeta("b", "float32", (5,))]
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 20)
    unpack_plan = UnpackPlan(metas, chunk)
    assert unpack_plan.in_place
    _post(link, 0, chunk, metas)
    want = ch.expect("want", deadline=time.monotonic() + 5, what="want")
    ch.send({"op": "ready", "c": 0, "e": 1})
    pairs = link.take(0, unpack_plan)
    assert [(n, t.dtype, tuple(t.shape)) for n, t in pairs] == [
        ("a", torch.bfloat16, (3, 4)),
        ("b", torch.float32, (5,)),
    ]
    log = cp.cuda.runtime.log
    assert log.index(("unpack",)) < log.index(
        ("wait", 77, 1002)
    )  # views first, then the stream waits
    buf = link.pool._buffers[want["b"]]
    assert buf.state == "leased"
    del pairs
    cp.leases.clear()  # type: ignore[attr-defined]
    assert buf.state == "free"  # torch let go: the next round may name it
    link.close()


def test_a_plan_that_copies_out_unpacks_only_after_the_ready(
    cp: Cupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    _real_tensors(cp, monkeypatch)
    _logged_unpack(cp, monkeypatch)
    link, ch, _ = connect_scripted(_pull)
    metas = [
        ParamMeta("odd", "uint8", (3,)),
        ParamMeta("f", "float32", (2,)),
    ]  # f at offset 3: copied out
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 20)
    unpack_plan = UnpackPlan(metas, chunk)
    assert not unpack_plan.in_place
    _post(link, 0, chunk, metas)
    ch.expect("want", deadline=time.monotonic() + 5, what="want")
    ch.send({"op": "ready", "c": 0, "e": 0})
    pairs = link.take(0, unpack_plan)
    assert [n for n, _ in pairs] == ["odd", "f"]
    log = cp.cuda.runtime.log
    assert log.index(("wait", 77, 1001)) < log.index(("unpack",))  # the copy-out reads filled bytes
    link.close()


def test_a_trainer_lost_before_the_ready_leaves_the_buffer_leased_ahead_unfreed(
    cp: Cupy, monkeypatch: pytest.MonkeyPatch
) -> None:
    _real_tensors(cp, monkeypatch)
    link, ch, _ = connect_scripted(_pull)
    metas = [ParamMeta("a", "bfloat16", (8,))]
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 20)
    _post(link, 0, chunk, metas)
    want = ch.expect("want", deadline=time.monotonic() + 5, what="want")
    ch.abort()  # the trainer dies mid-fill
    with pytest.raises(PeerLost, match="while this side waited for chunk 0"):
        link.take(0, UnpackPlan(metas, chunk))
    cp.leases.clear()  # type: ignore[attr-defined]  # the views are gone with the failed round
    assert link.pool._buffers[want["b"]].state == "filling"  # not free: the copy may still run
    link.abort()
    assert not [e for e in cp.cuda.runtime.log if e[0] == "free"]


# -- a round of no tensors, release-after-round: the real trainer pipeline on the channel ------


def test_a_round_of_no_tensors_leaves_no_unmapped_for_the_next_round_to_meet(cp: Cupy) -> None:
    """Release-after-round, a turn of no chunk (a round of no tensors): the worker never
    reaches the round tail that reads "unmapped" (its last chunk's), so the trainer's
    ``IPCPullPipeline`` (on this link's channel, its own fake runtime) says none for it (was:
    sent, left unread, and the next round met it where chunk 0's "ready" was due: "sent
    'unmapped' where chunk 0 ('ready') was due", that round failed); the next round reads its
    own and frees the pool after it. (The engine sends no round of no tensors: its update
    info would read as metadata reuse, ``tests/faults/test_api_misuse.py``; this is the
    data path's own rule.)"""
    from tests.trainer.ipc_pull_worker import PullCupy
    from tests.trainer.test_ipc_pipeline import FakePacker, _prepared
    from weightwire.backends.base import Outgoing
    from weightwire.backends.ipc.link import IPCSenderComm
    from weightwire.backends.ipc.pull import IPCPullPipeline
    from weightwire.backends.ipc.slots import IPCSlots
    from weightwire.backends.worker_base import ReceiveProgress

    link, ch, _ = connect_scripted(_pull, release=True)
    trainer_cp = PullCupy([])
    slots = IPCSlots(trainer_cp, 0, 100, 2)
    slots.free_memory()  # pull: the ring's buffers go at join, its ready events stay
    comm = IPCSenderComm(trainer_cp, slots, [ch], [[11, 12]], [""], True, "pull")
    pipe = IPCPullPipeline(comm, FakePacker(), timeout=5.0)
    try:
        assert pipe.send(Outgoing([], threading.Event())) == (0, 0)
        empty = ReceiveTurn(0, [], [], [], packed=True)
        assert list(link.receive(empty, ReceiveProgress())) == []

        sent: list[Any] = []
        trainer = threading.Thread(
            target=lambda: sent.append(pipe.send(Outgoing(_prepared([60], 100), threading.Event())))
        )
        trainer.start()
        metas, chunks = _round([60])
        _post(link, 0, chunks[0], metas)  # its only chunk: the round's tail reads "unmapped"
        link.wait(0)
        trainer.join(10)
        assert sent == [(60, 1)]
        cp.leases.clear()  # type: ignore[attr-defined]  # loaded: the lease dies, the pool goes
        assert link.held_bytes() == 0
        assert [e[0] for e in cp.cuda.runtime.log if e[0] == "free"] == ["free"]
    finally:
        pipe.close()
        link.close()
