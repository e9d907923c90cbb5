"""``weightwire_nccl``'s sliced-round wire on CPU: the chunk layout both ends derive, the
table a worker checks before it receives a byte of its chunks, the point-to-point calls
(``ncclSend`` / ``ncclRecv`` with CuPy's arguments, grouped), and the hellos moving over an
in-process NCCL world (``fake_nccl_p2p``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.backends.fake_cupy import make_comm, names
from tests.backends.fake_nccl_p2p import FakeDeviceArray, World
from weightwire.backends.device import DeviceBytes
from weightwire.backends.nccl.slices import (
    LENGTH,
    TABLE_HEAD,
    parse_table,
    recv_hellos,
    send_hello,
    table_bytes,
)
from weightwire.shared.errors import TransferError, TransferTimeout
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slice_wire import ChunkSpan, chunk_layout, piece_header
from weightwire.shared.slices import Box

METAS = [ParamMeta("a", "float32", (4, 3)), ParamMeta("b", "bfloat16", (5,))]


def test_chunks_take_pieces_while_they_fit_each_piece_aligned() -> None:
    spans, offsets = chunk_layout([12, 6, 10, 40, 4], 32)
    # 12 at 0, 6 at 16 (aligned), 10 would end at 34 > 32: a new chunk; 40 is a chunk alone
    assert spans == [
        ChunkSpan(0, 2, 22),
        ChunkSpan(2, 3, 10),
        ChunkSpan(3, 4, 40),
        ChunkSpan(4, 5, 4),
    ]
    assert offsets == [0, 16, 0, 0, 0]
    assert chunk_layout([], 32) == ([], [])
    with pytest.raises(ValueError, match="buffer_bytes must be positive"):
        chunk_layout([1], 0)


def test_a_table_gives_the_pieces_and_chunks_the_sender_packed() -> None:
    heads = [(0, Box.of((0, 2), (0, 3))), (1, Box.of((3, 5))), (0, Box.of((2, 4), (0, 3)))]
    pieces, spans = parse_table(table_bytes(heads, 32), METAS, "test")
    assert [(p.tensor, p.box, p.offset, p.nbytes) for p in pieces] == [
        (0, Box.of((0, 2), (0, 3)), 0, 24),
        (1, Box.of((3, 5)), 24, 4),
        (0, Box.of((2, 4), (0, 3)), 0, 24),
    ]
    assert spans == [ChunkSpan(0, 2, 28), ChunkSpan(2, 3, 24)]
    assert parse_table(table_bytes([], 32), METAS, "test") == ([], [])


def test_a_bad_table_is_refused_before_any_chunk_naming_the_problem() -> None:
    ok = piece_header(0, Box.of((0, 1), (0, 3)))
    bad = {
        "ends inside its head": b"\x00\x00",
        "ends inside its piece headers": TABLE_HEAD.pack(2, 32) + ok,
        "holds 3 bytes past its 1 headers": TABLE_HEAD.pack(1, 32) + ok + b"xyz",
        "names tensor #2; the update lists 2": table_bytes([(2, Box.of((0, 1)))], 32),
        r"'a' is box \[3:5, 0:3\], empty or outside": table_bytes(
            [(0, Box.of((3, 5), (0, 3)))], 32
        ),
        "packs its pieces into chunks of 0 bytes": TABLE_HEAD.pack(1, 0) + ok,
    }
    for match, raw in bad.items():
        with pytest.raises(TransferError, match=match):
            parse_table(raw, METAS, "test")


def test_point_to_point_calls_pass_cupys_arguments_and_refuse_bad_peers() -> None:
    comm, raw, cp = make_comm(world_size=3)
    raw.send = lambda *a: raw.calls.append(("send", *a))
    raw.recv = lambda *a: raw.calls.append(("recv", *a))
    groups: list[str] = []
    cp.cuda.nccl = type(
        "N", (), {"groupStart": lambda: groups.append("("), "groupEnd": lambda: groups.append(")")}
    )
    view = DeviceBytes(0xF100, 16, 0, None)
    with comm.group():
        comm.send(view, peer=1, stream=0x77)
        comm.recv(view, peer=2, stream=0x77)
    assert groups == ["(", ")"]
    # (ptr, count, ncclUint8, peer, stream): NcclCommunicator.send / recv
    assert raw.calls == [("send", 0xF100, 16, 1, 1, 0x77), ("recv", 0xF100, 16, 1, 2, 0x77)]
    comm.send(DeviceBytes(0, 0, 0, None), peer=1, stream=0x77)  # empty: no NCCL call
    assert len(raw.calls) == 2
    for peer in (0, 3, True):
        with pytest.raises(ValueError, match="peer must be another rank in"):
            comm.send(view, peer=peer, stream=0x77)
    with pytest.raises(ValueError, match="enqueues on a stream"):
        comm.recv(view, peer=1, stream=None)
    assert "abort" not in names(raw)


def test_hellos_move_from_each_worker_to_rank_0_in_rank_order() -> None:
    world = World(3)
    comms = [world.comm(r) for r in range(3)]
    said = {1: b'{"tensors": {}}', 2: b""}

    def worker(rank: int) -> None:
        def device(data: bytes) -> FakeDeviceArray:
            return FakeDeviceArray(np.frombuffer(data, dtype=np.uint8).copy())

        send_hello(comms[rank], said[rank], device, comms[rank].new_stream())

    threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    assert recv_hellos(comms[0], timeout=10) == [said[1], b""]
    for t in threads:
        t.join(10)
    # rank 1 sent its length and its hello; rank 2 its length only
    assert world.sent_bytes == [0, LENGTH.size + len(said[1]), LENGTH.size]


def test_a_worker_that_sends_no_hello_times_out_rank_0_and_aborts_it() -> None:
    world = World(2)
    trainer, peer = world.comm(0), world.comm(1)
    # the worker joined the pair (its first call) but sends nothing
    world.calls.add((1, 0))
    with pytest.raises(TransferTimeout, match="did not finish within 0.2 s on rank 0"):
        recv_hellos(trainer, timeout=0.2)
    assert 0 in world.aborted and peer is not None


def test_a_worker_refuses_an_oversized_table_before_receiving_it() -> None:
    import torch

    from weightwire.backends.nccl.slices import MAX_TABLE_BYTES
    from weightwire.backends.nccl.worker import NCCLLink
    from weightwire.backends.worker_base import ReceiveProgress

    def sent(*messages: bytes) -> NCCLLink:
        world = World(2)
        trainer, worker = world.comm(0), world.comm(1)
        world.calls.add((1, 0))  # the worker is connected: rank 0's sends do not wait
        stream = trainer.new_stream()
        for m in messages:
            trainer.send(FakeDeviceArray(np.frombuffer(m, np.uint8).copy()), peer=1, stream=stream)
        return NCCLLink(worker, device=torch.device("cpu"), timeout_s=5, depth=2)

    link = sent(LENGTH.pack(MAX_TABLE_BYTES + 1))
    with pytest.raises(TransferError, match=r"announced a \d+-byte table, over the"):
        next(link.receive_sliced(METAS, ReceiveProgress()))
    # the pieces of a whole "a" twice: more bytes than the update carries
    table = table_bytes([(0, Box.of((0, 4), (0, 3)))] * 2, 1 << 10)
    link = sent(LENGTH.pack(len(table)), table)
    with pytest.raises(TransferError, match="hold 96 bytes, more than the update's 58"):
        next(link.receive_sliced(METAS, ReceiveProgress()))


def test_a_failed_group_aborts_the_communicator_naming_it() -> None:
    comm, raw, cp = make_comm(world_size=2)

    def fail() -> None:
        raise RuntimeError("ncclInvalidUsage")

    cp.cuda.nccl = type("N", (), {"groupStart": lambda: None, "groupEnd": fail})
    failed = pytest.raises(
        TransferError, match="NCCL group of calls failed on rank 0.*InvalidUsage"
    )
    with failed, comm.group():
        pass
    assert names(raw) == ["abort"]
    with pytest.raises(TransferError, match="is aborted"):
        comm.send(DeviceBytes(0xF100, 16, 0, None), peer=1, stream=0x77)
