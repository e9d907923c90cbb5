"""Packing pipelines: the JAX fused packer against the numpy reference, the device
pipeline's stream rotation (with a recording communicator), the host pipeline's
error propagation and bounded read-ahead."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from weightwire.backends.base import DevicePacker, Outgoing, RoundAborted
from weightwire.backends.device import DeviceBytes, SlotBuffers
from weightwire.backends.pipelines import DevicePipeline, HostPipeline
from weightwire.jax_side.packer import pack_bytes
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import PeerLost
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.transfer import chunked


def mixed() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16),
        np.array(2.5, np.float32),
        np.array([True, False, True, True]),
        rng.standard_normal(9).astype(ml_dtypes.float8_e4m3fn),
        np.zeros((0, 4), np.float16),
        rng.integers(-9, 9, (2, 2)).astype(np.int32),
        rng.standard_normal((3, 1)).astype(np.float16),
    ]


def test_jax_fused_pack_matches_the_numpy_reference() -> None:
    arrays = mixed()
    metas = [
        ParamMeta(f"t{i}", np.dtype(a.dtype).name if a.dtype != np.bool_ else "bool", a.shape)
        for i, a in enumerate(arrays)
    ]
    for chunk in plan(metas, packed=True, buffer_size_bytes=20):
        got = np.asarray(pack_bytes([jnp.asarray(a) for a in arrays[chunk.start : chunk.stop]]))
        assert (
            got.dtype == np.uint8
            and got.tobytes() == pack_host(arrays[chunk.start : chunk.stop], chunk).tobytes()
        )
    whole = np.asarray(pack_bytes([jnp.asarray(a) for a in arrays]))
    assert whole.tobytes() == b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


class NumpyPacker(DevicePacker):
    def __init__(self) -> None:
        self.streams = 0
        self.ordinal = 0

    def new_stream(self) -> str:
        self.streams += 1
        return f"s{self.streams - 1}"

    def regions(self, tensors: Any, stream: Any) -> list[np.ndarray]:
        return [np.ascontiguousarray(t).reshape(-1).view(np.uint8) for t in tensors]


class NumpySlots:
    """Host stand-in for ``SlotBuffers``: a gather is a concatenation."""

    def gather(self, slot: int, parts: Any, nbytes: int, stream: Any) -> np.ndarray:
        out = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        assert out.nbytes == nbytes
        return out

    def slot(self, slot: int, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def settled(self, slot: int) -> None:
        return None

    def release(self) -> None:
        return None


def device_pipeline(
    comm: Any, packer: DevicePacker, *, packed: bool = True, hold_bytes: int = 1 << 20
) -> DevicePipeline:
    return DevicePipeline(
        comm, packer, NumpySlots(), packed=packed, num_buffers=2, timeout=5, hold_bytes=hold_bytes
    )


def test_slot_buffers_gather_regions_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the NCCL backend does with a framework packer's regions: gathered back to
    # back into the slot's buffer on the stream, one copy per region.
    copies: list[tuple[int, int, int, int]] = []

    class Buf:
        def __init__(self, n: int) -> None:
            self.nbytes, self.data = n, SimpleNamespace(ptr=0x1000)

        def __getitem__(self, s: slice) -> Buf:
            return Buf(s.stop)

    runtime = SimpleNamespace(
        memcpyDeviceToDevice=3,
        memcpyAsync=lambda dst, src, n, kind, stream: copies.append((dst, src, n, stream)),
    )
    cupy = SimpleNamespace(
        uint8="uint8",
        empty=lambda n, dtype: Buf(n),
        cuda=SimpleNamespace(runtime=runtime, Device=lambda d: contextlib.nullcontext()),
        get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
    )
    monkeypatch.setitem(sys.modules, "cupy", cupy)

    buffers = SlotBuffers(cupy, 0)
    regions = [DeviceBytes(0xA0, 10, 0, None), DeviceBytes(0xB0, 6, 0, None)]
    out = buffers.gather(0, regions, 16, 0x55)
    assert out.nbytes == 16 and copies == [(0x1000, 0xA0, 10, 0x55), (0x100A, 0xB0, 6, 0x55)]
    with pytest.raises(ValueError, match="chunk tensors hold 16 bytes, the plan says 20"):
        buffers.gather(1, regions, 20, 0x55)
    buffers.settled(0)
    buffers.release()
    assert buffers.held_bytes() == 0


class StreamComm:
    """Records enqueue / synchronize order per stream; nothing runs asynchronously."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def broadcast(self, buf: Any, *, root: int, timeout: float, stream: Any) -> None:
        self.log.append(("bcast", stream, bytes(buf)))

    def broadcast_typed(
        self, buf: Any, *, nccl_dtype: int, count: int, root: int, timeout: float, stream: Any
    ) -> None:
        self.log.append(("typed", stream, nccl_dtype, count, bytes(buf)))

    def synchronize(self, stream: Any, *, timeout: float) -> None:
        self.log.append(("sync", stream))


def test_device_pipeline_rotates_streams_and_waits_only_on_slot_reuse() -> None:
    arrays = [np.full(3, i, np.float32) for i in range(5)]
    metas = [ParamMeta(f"t{i}", "float32", (3,)) for i in range(5)]
    chunks = plan(metas, packed=True, buffer_size_bytes=12)  # 12 is not > 12: two tensors per chunk
    comm, packer = StreamComm(), NumpyPacker()
    assert [len(c) for c in chunks] == [2, 2, 1]
    pipe = device_pipeline(comm, packer)
    nbytes, count = pipe.send(
        Outgoing(
            chunked(zip([m.name for m in metas], arrays, strict=True), chunks), threading.Event()
        )
    )
    assert (nbytes, count) == (60, len(chunks)) and packer.streams == 2
    kinds = [(e[0], e[1]) for e in comm.log]
    # chunk k goes on stream k % 2; stream s is synchronized before its second use; all
    # drained at the end
    want: list[tuple] = []
    for k in range(len(chunks)):
        if k >= 2:
            want.append(("sync", f"s{k % 2}"))
        want.append(("bcast", f"s{k % 2}"))
    want += [("sync", "s0"), ("sync", "s1")]
    assert kinds == want
    sent = b"".join(e[2] for e in comm.log if e[0] == "bcast")
    assert sent == b"".join(a.tobytes() for a in arrays)


def test_device_pipeline_unpacked_uses_each_tensors_nccl_dtype() -> None:
    arrays = [
        np.ones((2, 3), ml_dtypes.bfloat16),
        np.arange(4, dtype=np.int32),
        np.array(1.0, np.float32),
    ]
    names = ["a", "b", "c"]
    metas = [
        ParamMeta("a", "bfloat16", (2, 3)),
        ParamMeta("b", "int32", (4,)),
        ParamMeta("c", "float32", ()),
    ]
    comm = StreamComm()
    pipe = device_pipeline(comm, NumpyPacker(), packed=False, hold_bytes=16)
    pipe.send(
        Outgoing(
            chunked(
                zip(names, arrays, strict=True), plan(metas, packed=False, buffer_size_bytes=1)
            ),
            threading.Event(),
            metas=metas,
        )
    )
    typed = [e for e in comm.log if e[0] == "typed"]
    assert [(e[2], e[3]) for e in typed] == [(wire_dtype(m.dtype).nccl, m.numel) for m in metas]
    assert [e[4] for e in typed] == [a.tobytes() for a in arrays]
    # 12 + 16 bytes held exceeds hold_bytes=16 after the second tensor: one early sync,
    # then the drain
    assert [e for e in comm.log if e[0] == "sync"] == [
        ("sync", "s0"),
        ("sync", "s0"),
        ("sync", "s1"),
    ]


def test_device_pipeline_stops_between_chunks_when_asked() -> None:
    stop = threading.Event()
    stop.set()
    pipe = device_pipeline(StreamComm(), NumpyPacker(), hold_bytes=1)
    metas = [ParamMeta("a", "float32", (1,))]
    with pytest.raises(RoundAborted):
        pipe.send(
            Outgoing(
                chunked(
                    [("a", np.zeros(1, np.float32))], plan(metas, packed=True, buffer_size_bytes=4)
                ),
                stop,
            )
        )


class HostComm:
    def __init__(self, fail_at: int | None = None) -> None:
        self.sent: list[bytes] = []
        self.fail_at = fail_at
        self.gate = threading.Semaphore(0)
        self.gated = False

    def broadcast(self, parts: list, *, root: int, timeout: float) -> None:
        if self.gated:
            self.gate.acquire(timeout=5)
        if self.fail_at is not None and len(self.sent) == self.fail_at:
            raise PeerLost("rank 1 closed the connection at byte 0 of 4")
        self.sent.append(b"".join(bytes(p) for p in parts))


def host_round(n: int) -> tuple[list[ParamMeta], list[np.ndarray], list]:
    arrays = [np.full(1, i, np.float32) for i in range(n)]
    metas = [ParamMeta(f"t{i}", "float32", (1,)) for i in range(n)]
    return metas, arrays, plan(metas, packed=False, buffer_size_bytes=1)


def test_host_pipeline_raises_the_senders_error_and_stops_reading() -> None:
    metas, arrays, chunks = host_round(50)
    pulled: list[int] = []

    def pairs():
        for i, (m, a) in enumerate(zip(metas, arrays, strict=True)):
            pulled.append(i)
            yield m.name, a

    comm = HostComm(fail_at=2)
    pipe = HostPipeline(comm, lambda a: a.view(np.uint8), num_buffers=2, timeout=5)
    with pytest.raises(PeerLost, match="rank 1 closed"):
        pipe.send(Outgoing(chunked(pairs(), chunks), threading.Event()))
    assert (
        len(comm.sent) == 2 and len(pulled) < 10
    )  # stopped soon after the failure, not at the end


def test_host_pipeline_reads_ahead_at_most_num_buffers_chunks() -> None:
    metas, arrays, chunks = host_round(12)
    comm = HostComm()
    comm.gated = True
    ahead: list[int] = []

    def host_bytes(a: np.ndarray) -> np.ndarray:
        ahead.append(int(a[0]) - len(comm.sent))  # chunks prepared beyond what was sent
        return a.view(np.uint8)

    pipe = HostPipeline(comm, host_bytes, num_buffers=3, timeout=5)
    done = threading.Event()
    result: list = []

    def run() -> None:
        result.append(
            pipe.send(
                Outgoing(
                    chunked(zip([m.name for m in metas], arrays, strict=True), chunks),
                    threading.Event(),
                )
            )
        )
        done.set()

    threading.Thread(target=run, daemon=True).start()
    # While the first chunk is held on the wire, the producer runs as far ahead as it may:
    # waited for (bounded), not slept for, so a busy host cannot make it look shallower.
    deadline = time.monotonic() + 10
    while max(ahead, default=-1) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    for _ in range(12):
        comm.gate.release()
    assert done.wait(10)
    assert result == [(48, 12)] and comm.sent == [a.tobytes() for a in arrays]
    # One on the wire, num_buffers - 1 queued, one being prepared: never more, and it does
    # read ahead.
    assert max(ahead) == 3


def test_jax_packer_regions_are_each_arrays_own_buffer() -> None:
    """``JaxDevicePacker.regions`` (its per-array shortcuts) against ``array_device_bytes``,
    on a CPU device: same pointer, size and device; an array elsewhere (here: numpy) is
    placed on the device first; an empty array points nowhere."""
    import jax

    from weightwire.backends.device import array_device_bytes
    from weightwire.jax_side.packer import JaxDevicePacker

    device = jax.devices()[0]
    packer = object.__new__(JaxDevicePacker)  # no cupy here: only what regions reads
    packer._bind(device)
    arrays = [
        jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
        jnp.ones(5, jnp.bfloat16),
        jnp.zeros((0, 3), jnp.float32),
        jnp.arange(7, dtype=jnp.int8),
        jnp.ones(5, jnp.bfloat16) * 2,
        np.arange(6, dtype=np.int32),
    ]
    for _ in range(2):  # the second pass reads the cached sizes
        got = packer.regions(arrays, None)
        assert [g.owner.devices() for g in got] == [{device}] * len(arrays)
        want = [array_device_bytes(g.owner) for g in got]
        assert [(g.ptr, g.nbytes, g.device) for g in got] == [
            (w.ptr, w.nbytes, w.device) for w in want
        ]
        assert [g.nbytes for g in got] == [48, 10, 0, 7, 10, 24] and got[2].ptr == 0
        assert all(
            g.owner is a for g, a in zip(got[:5], arrays, strict=False)
        )  # jax arrays: no copy
        assert np.array_equal(np.asarray(got[5].owner), arrays[5])
