"""TCP data plane: bytes arrive intact across processes, in both framings, for every dtype."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from tcp_pairs import accepted, joined
from test_tcp_peer import Peers, digest

from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.shared.communicator import Communicator
from weightwire.shared.dtypes import SUPPORTED_DTYPES, wire_dtype
from weightwire.shared.errors import TransferError
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.meta import ParamMeta

BIG = 256 << 20


def make_round(total: int, seed: int = 0) -> tuple[list[ParamMeta], list[np.ndarray]]:
    """Every wire dtype: one large 2-D tensor, a 3-D odd one, a scalar; a uint8 filler
    makes ``total`` exact."""
    rng = np.random.default_rng(seed)
    per_dtype = total // (len(SUPPORTED_DTYPES) + 1)
    metas: list[ParamMeta] = []
    for name in SUPPORTED_DTYPES:
        size = wire_dtype(name).itemsize
        metas += [
            ParamMeta(f"{name}.big", name, (per_dtype // (1000 * size), 1000)),
            ParamMeta(f"{name}.odd", name, (3, 5, 7)),
            ParamMeta(f"{name}.scalar", name, ()),
        ]
    metas.append(ParamMeta("filler", "uint8", (total - sum(m.nbytes for m in metas),)))
    arrays = []
    for meta in metas:
        row = wire_dtype(meta.dtype)
        if meta.dtype == "bool":
            arrays.append(rng.integers(0, 2, meta.shape, dtype=np.uint8).astype(np.bool_))
        else:  # any bit pattern (NaNs included) must survive, so fill raw bytes
            raw = rng.integers(0, 256, meta.nbytes, dtype=np.uint8)
            arrays.append(raw.view(row.numpy).reshape(meta.shape))
    return metas, arrays


@pytest.fixture(scope="module")
def big_round() -> tuple[list[ParamMeta], list[np.ndarray], dict[str, str]]:
    metas, arrays = make_round(BIG)
    assert sum(m.nbytes for m in metas) == BIG
    return metas, arrays, {m.name: digest(a) for m, a in zip(metas, arrays, strict=True)}


def send_round(
    comm: TCPCommunicator,
    metas: list[ParamMeta],
    arrays: list[np.ndarray],
    *,
    packed: bool,
    buffer_size: int,
) -> int:
    chunks = plan(metas, packed=packed, buffer_size_bytes=buffer_size)
    out = np.empty(max(c.nbytes for c in chunks), dtype=np.uint8)
    for chunk in chunks:
        if packed:
            comm.broadcast(pack_host(arrays[chunk.start : chunk.stop], chunk, out), timeout=60)
        else:  # unpacked: the tensor's own memory, no staging copy
            comm.broadcast(arrays[chunk.start], timeout=60)
    return len(chunks)


def run_round(
    receivers: int, metas, arrays, *, packed: bool, buffer_size: int
) -> tuple[int, list[dict]]:
    with Peers() as peers, TCPRendezvous(world_size=receivers + 1) as rendezvous:
        config = {
            **rendezvous.init_fields(),
            "world_size": receivers + 1,
            "packed": packed,
            "buffer_size": buffer_size,
            "metas": [m.to_dict() for m in metas],
        }
        procs = [peers.spawn("recv", {**config, "rank": r}) for r in range(1, receivers + 1)]
        comm = rendezvous.accept(timeout=60)
        with comm:
            comm.warmup(timeout=60)
            nchunks = send_round(comm, metas, arrays, packed=packed, buffer_size=buffer_size)
        return nchunks, [p.result(timeout=120) for p in procs]


@pytest.mark.slow
@pytest.mark.parametrize("receivers", [1, 3])
def test_packed_256mib_every_dtype_reaches_every_receiver(receivers, big_round):
    metas, arrays, expected = big_round
    nchunks, results = run_round(receivers, metas, arrays, packed=True, buffer_size=64 << 20)
    assert nchunks >= 3  # several broadcasts, one sequence
    for result in results:
        assert result["ok"], result
        assert result["digests"] == expected


def test_unpacked_framing_one_broadcast_per_tensor():
    metas, arrays = make_round(1 << 20, seed=1)
    metas.append(ParamMeta("empty", "bfloat16", (0, 8)))
    arrays.append(np.zeros((0, 8), dtype=ml_dtypes.bfloat16))
    nchunks, results = run_round(2, metas, arrays, packed=False, buffer_size=1 << 20)
    assert nchunks == len(metas)
    for result in results:
        assert result["ok"], result
        assert result["digests"] == {m.name: digest(a) for m, a in zip(metas, arrays, strict=True)}


# -- in-process pairs (threads) for the finer contract ------------------------------


def test_parts_are_one_logical_buffer_on_both_sides():
    root, (recv,) = joined()
    parts = [
        np.arange(1000, dtype=np.float32),
        np.ones((3, 4), dtype=ml_dtypes.bfloat16),
        b"tail",
        bytearray(0),
    ]
    whole = b"".join(
        np.ascontiguousarray(p).tobytes() if isinstance(p, np.ndarray) else bytes(p) for p in parts
    )
    with ThreadPoolExecutor(1) as pool:
        single = np.empty(len(whole), dtype=np.uint8)
        fut = pool.submit(recv.broadcast, single, timeout=10)
        root.broadcast(parts, timeout=10)
        fut.result(timeout=10)
        assert single.tobytes() == whole
        split = [np.empty(7, dtype=np.uint8), np.empty(len(whole) - 7, dtype=np.uint8)]
        fut = pool.submit(recv.broadcast, split, timeout=10)
        root.broadcast(memoryview(whole), timeout=10)
        fut.result(timeout=10)
        assert b"".join(s.tobytes() for s in split) == whole
    root.close()
    recv.close()


def test_concurrent_receivers_get_the_same_bytes_repeatedly():
    root, receivers = joined(4)
    data = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8)
    with ThreadPoolExecutor(3) as pool:
        for step in range(5):
            bufs = [np.empty_like(data) for _ in receivers]
            futs = [
                pool.submit(r.broadcast, b, timeout=20)
                for r, b in zip(receivers, bufs, strict=True)
            ]
            root.broadcast(np.roll(data, step), timeout=20)
            for f in futs:
                f.result(timeout=20)
            want = hashlib.sha256(np.roll(data, step)).hexdigest()
            assert [hashlib.sha256(b).hexdigest() for b in bufs] == [want] * 3
    for c in (root, *receivers):
        c.close()


def test_size_mismatch_is_a_clear_desync_error_not_garbage():
    root, (recv,) = joined()
    buf = np.full(999, 7, dtype=np.uint8)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(recv.broadcast, buf, timeout=10)
        root.broadcast(np.zeros(1000, dtype=np.uint8), timeout=10)
        with pytest.raises(
            TransferError,
            match=r"broadcast #0: this receiver expected 999 bytes, the sender sent 1000",
        ):
            fut.result(timeout=10)
    assert (buf == 7).all()  # not a byte was loaded
    with pytest.raises(TransferError, match="aborted"):
        recv.broadcast(buf, timeout=1)
    root.close()


def test_bad_buffers_are_refused_before_any_byte_moves():
    root, (recv,) = joined()
    with pytest.raises(ValueError, match="C-contiguous"):
        root.broadcast(np.zeros((4, 4), dtype=np.float32)[:, ::2])
    with pytest.raises(ValueError, match="read-only"):
        recv.broadcast(b"immutable")
    with pytest.raises(TypeError, match="host memory"):
        root.broadcast(object())
    with pytest.raises(ValueError, match="only from rank 0"):
        root.broadcast(b"x", root=1)
    with pytest.raises(ValueError, match="timeout"):
        root.broadcast(b"x", timeout=0)
    # still usable: nothing was sent
    buf = np.empty(3, dtype=np.uint8)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(recv.broadcast, buf, timeout=10)
        root.broadcast(b"abc", timeout=10)
        fut.result(timeout=10)
    assert buf.tobytes() == b"abc"
    root.close()
    recv.close()


def test_explicit_socket_buffers_path_moves_bytes():
    above = 1 << 30  # above any autotuning ceiling
    rendezvous = TCPRendezvous(world_size=2, socket_buffer_bytes=above)
    root, (recv,) = accepted(rendezvous, socket_buffer_bytes=above)
    with ThreadPoolExecutor(1) as pool:
        data = np.arange(1 << 20, dtype=np.int64)
        out = np.empty_like(data)
        fut = pool.submit(recv.broadcast, out, timeout=10)
        root.broadcast(data, timeout=10)
        fut.result(timeout=10)
    assert np.array_equal(out, data)
    root.close()
    recv.close()


def test_communicator_protocol_and_no_secret_in_repr():
    rendezvous = TCPRendezvous(world_size=2)
    secret = rendezvous.secret
    assert len(secret) == 128
    fields = rendezvous.init_fields()
    info = TCPInitInfo(**fields, rank_offset=1, world_size=2)
    assert info.secret == secret and info.port == rendezvous.port
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(
            TCPCommunicator.connect,
            host=info.host,
            port=info.port,
            secret=info.secret,
            rank=1,
            world_size=2,
            timeout=10,
        )
        root = rendezvous.accept(timeout=10)
        recv = fut.result(timeout=10)
    for obj in (rendezvous, root, recv, info):
        text = repr(obj) + str(obj)
        assert fields["secret_b64"] not in text and fields["secret_b64"][:16] not in text
        assert secret.hex()[:32] not in text and repr(secret)[:40] not in text
    assert isinstance(root, Communicator) and isinstance(recv, Communicator)
    assert (root.rank, root.world_size, recv.rank, recv.world_size) == (0, 2, 1, 2)
    root.close()
    recv.close()
    with pytest.raises(TransferError, match="closed"):
        root.broadcast(b"x")
