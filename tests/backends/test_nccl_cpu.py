"""CPU-side tests of the NCCL transport: no GPU, no CuPy needed.

The import/availability tests run against the real environment (CuPy absent, or
hidden). The logic tests (init timeout, watchdog, abort, argument checks) drive
``NCCLCommunicator`` through a minimal in-memory stand-in for CuPy's API, so what is
asserted is our own control flow: which NCCL calls are made, with which arguments,
and what is raised when NCCL never answers.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import weightwire.backends.nccl.comm as nccl_mod
import weightwire.backends.nccl.library as nccl_library
from tests.backends.fake_cupy import FakeArray, FakeComm, FakeCupy, FakeStream, make_comm, names
from weightwire.backends.device import DeviceBytes, stream_pointer
from weightwire.backends.nccl.comm import NCCLCommunicator
from weightwire.backends.nccl.join import unique_id_to_bytes, unique_id_to_signed_tuple
from weightwire.backends.nccl.library import NCCLUnavailable, format_nccl_version
from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout

UID = bytes(range(128))


# -- without CuPy --------------------------------------------------------------------------------


def test_import_without_cupy_is_harmless_and_pulls_no_framework() -> None:
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import weightwire.backends.nccl.comm\n"
        "import weightwire.backends.nccl.library as n\n"
        "assert not n.nccl_available()\n"
        "assert 'torch' not in sys.modules and 'jax' not in sys.modules, sorted(sys.modules)\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_use_without_cupy_raises_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert nccl_library.nccl_available() is False
    for call in (nccl_library.mint_unique_id, nccl_library.nccl_version):
        with pytest.raises(NCCLUnavailable, match=r"needs CuPy with NCCL.*cupy-cuda13x"):
            call()
    with pytest.raises(NCCLUnavailable, match="needs CuPy with NCCL"):
        NCCLCommunicator.join(unique_id=UID, rank=0, world_size=2, timeout=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"unique_id": b"x" * 127}, "unique_id must be 128 bytes, got 127 bytes"),
        ({"unique_id": "a" * 128}, "unique_id must be 128 bytes, got str"),
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"rank": 2}, r"rank must be an int in \[0, 2\), got 2"),
        ({"rank": True}, "rank must be an int"),
        ({"timeout": 0}, "timeout must be a positive finite number"),
        ({"timeout": float("inf")}, "timeout must be a positive finite number"),
    ],
)
def test_join_checks_arguments_before_touching_cupy(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict, message: str
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # validation must come first
    args = {"unique_id": UID, "rank": 0, "world_size": 2, "timeout": 5.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        NCCLCommunicator.join(**args)


def test_unique_id_round_trips_through_cupy13_signed_tuple() -> None:
    signed = unique_id_to_signed_tuple(bytes(range(256)))
    assert min(signed) == -128 and max(signed) == 127
    for raw in (bytes(range(128)), bytes(range(128, 256))):
        assert unique_id_to_bytes(unique_id_to_signed_tuple(raw)) == raw
        assert unique_id_to_bytes(raw) == raw
    with pytest.raises(ValueError, match="must be 128 bytes, got 3"):
        unique_id_to_bytes(b"abc")
    with pytest.raises(TypeError, match="unexpected NCCL unique id type str"):
        unique_id_to_bytes("x" * 128)


def test_nccl_version_codes() -> None:
    assert format_nccl_version(22809) == "2.28.9"
    assert format_nccl_version(21805) == "2.18.5"
    assert format_nccl_version(2708) == "2.7.8"


def test_stream_pointer_accepts_stream_shapes_and_refuses_others() -> None:
    class CudaStreamProtocol:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 0x77)

    assert stream_pointer(0x42) == 0x42
    assert stream_pointer(SimpleNamespace(cuda_stream=0x43)) == 0x43  # torch.cuda.Stream
    assert stream_pointer(SimpleNamespace(ptr=0x44)) == 0x44  # CuPy stream
    assert stream_pointer(CudaStreamProtocol()) == 0x77
    for bad in (True, "0x1", 1.5):
        with pytest.raises(TypeError, match="stream"):
            stream_pointer(bad)


# -- join: the init watchdog -------------------------------------------------------------------


def fake_nccl(comm_factory: object) -> SimpleNamespace:
    return SimpleNamespace(available=True, NcclCommunicator=comm_factory, get_version=lambda: 22809)


def test_join_times_out_naming_rank_and_world_and_aborts_a_late_communicator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate, late = threading.Event(), FakeComm()

    def never_until_released(world: int, uid: bytes, rank: int) -> FakeComm:
        gate.wait(30)  # a peer that never arrives, until the test lets it
        return late

    cp = FakeCupy()
    monkeypatch.setattr(nccl_mod, "load_nccl", lambda: (cp, fake_nccl(never_until_released)))
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match=r"rank 1 of world size 3 .*never joined"):
        NCCLCommunicator.join(unique_id=UID, rank=1, world_size=3, device=1, timeout=0.3)
    assert time.monotonic() - start < 5
    gate.set()
    deadline = time.monotonic() + 10
    while names(late) != ["abort"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert names(late) == ["abort"], "a communicator completed after the timeout must be aborted"
    assert 1 in cp.current_device.values(), "init must run with the requested CUDA device current"


def test_join_falls_back_to_signed_tuple_for_older_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []

    def cupy13(world: int, uid: object, rank: int) -> FakeComm:
        if not isinstance(uid, tuple):
            raise TypeError("Argument 'commId' has incorrect type (expected tuple, got bytes)")
        seen.append(uid)
        return FakeComm()

    monkeypatch.setattr(nccl_mod, "load_nccl", lambda: (FakeCupy(), fake_nccl(cupy13)))
    uid = bytes(range(128, 256))
    comm = NCCLCommunicator.join(unique_id=uid, rank=0, world_size=2, timeout=5)
    assert seen == [unique_id_to_signed_tuple(uid)]
    assert (comm.rank, comm.world_size, comm.device, comm.version) == (0, 2, 0, "2.28.9")
    assert "unique" not in repr(comm) and str(list(uid[:4])) not in repr(comm)


def test_join_failure_is_transfer_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(world: int, uid: bytes, rank: int) -> FakeComm:
        raise RuntimeError("NCCL_ERROR_INVALID_USAGE: bad rank")

    monkeypatch.setattr(nccl_mod, "load_nccl", lambda: (FakeCupy(), fake_nccl(broken)))
    with pytest.raises(TransferError, match="rank 0 of world size 2.*NCCL_ERROR_INVALID_USAGE"):
        NCCLCommunicator.join(unique_id=UID, rank=0, world_size=2, timeout=5)
    with pytest.raises(ValueError, match=r"device must be a CUDA device index in \[0, 2\), got 5"):
        NCCLCommunicator.join(unique_id=UID, rank=0, world_size=2, device=5, timeout=5)


# -- collectives and the synchronize watchdog ---------------------------------------------------


def test_warmup_is_one_float32_sum_all_reduce_then_sync() -> None:
    comm, raw, _ = make_comm()
    comm.warmup(timeout=1)
    assert raw.calls == [("allReduce", 0xB000, 0xB000, 1, 7, 0, 0x5000)]


def test_broadcast_sends_uint8_in_place_and_only_enqueues_on_a_given_stream() -> None:
    comm, raw, cp = make_comm(complete=False)  # nothing ever completes: any wait would time out
    comm.broadcast(FakeArray(1000, ptr=0xC000), root=1, stream=0x99)
    comm.broadcast(FakeArray(10, ptr=0xD000), stream=SimpleNamespace(cuda_stream=0x98))
    assert raw.calls == [
        ("broadcast", 0xC000, 0xC000, 1000, 1, 1, 0x99),
        ("broadcast", 0xD000, 0xD000, 10, 1, 0, 0x98),
    ]
    cp.complete = True
    comm.broadcast(FakeArray(7, ptr=0xE000), timeout=1)  # internal stream, waits
    assert raw.calls[-1] == ("broadcast", 0xE000, 0xE000, 7, 1, 0, 0x5000)


def test_broadcast_typed_uses_the_tensor_dtype_and_checks_its_size() -> None:
    comm, raw, _ = make_comm()
    comm.broadcast_typed(FakeArray(64), nccl_dtype=9, count=32, timeout=1)  # bf16
    assert raw.calls == [("broadcast", 0xA000, 0xA000, 32, 9, 0, 0x5000)]
    with pytest.raises(
        ValueError, match="32 elements of ncclDataType_t 7 are 128 bytes but the buffer holds 64"
    ):
        comm.broadcast_typed(FakeArray(64), nccl_dtype=7, count=32, timeout=1)
    with pytest.raises(ValueError, match="unknown ncclDataType_t 42"):
        comm.broadcast_typed(FakeArray(64), nccl_dtype=42, count=64)


def test_synchronize_timeout_aborts_and_raises_then_communicator_is_dead() -> None:
    comm, raw, _ = make_comm(complete=False, rank=1, world_size=4)
    start = time.monotonic()
    with pytest.raises(
        TransferTimeout, match=r"within 0.3 s on rank 1 of world size 4 .*communicator aborted"
    ):
        comm.broadcast(FakeArray(8), root=0, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 5
    assert names(raw) == ["broadcast", "abort"]
    with pytest.raises(TransferError, match="is aborted: NCCL work did not finish"):
        comm.broadcast(FakeArray(8), timeout=1)
    comm.abort()
    comm.close()
    assert names(raw) == ["broadcast", "abort"], (
        "abort/close after an abort must not touch NCCL again"
    )


def test_async_remote_error_raises_peer_lost_and_aborts() -> None:
    comm, raw, _ = make_comm(complete=False)
    raw.async_error = type("NcclError", (RuntimeError,), {"status": 6})(
        "NCCL_ERROR_REMOTE_ERROR: peer exited"
    )
    with pytest.raises(PeerLost, match="asynchronous error on rank 0 of world size 2.*peer exited"):
        comm.synchronize(None, timeout=10)
    assert names(raw) == ["abort"]


def test_abort_from_another_thread_ends_a_wait() -> None:
    comm, raw, _ = make_comm(complete=False)
    threading.Timer(0.2, comm.abort).start()
    start = time.monotonic()
    with pytest.raises(TransferError, match="aborted by abort"):
        comm.synchronize(None, timeout=30)
    assert time.monotonic() - start < 5
    assert names(raw) == ["abort"]


def test_buffers_nccl_cannot_read_are_refused_by_name() -> None:
    torch = pytest.importorskip("torch")
    comm, raw, _ = make_comm()
    with pytest.raises(ValueError, match=r"host \(CPU\) memory; NCCL needs a CUDA device buffer"):
        comm.broadcast(np.zeros(4, dtype=np.uint8), timeout=1)
    with pytest.raises(ValueError, match=r"host \(CPU\) memory"):
        comm.broadcast(torch.zeros(4, dtype=torch.bfloat16), timeout=1)
    with pytest.raises(TypeError, match="must be a CUDA device array .* got bytes"):
        comm.broadcast(b"abcd", timeout=1)
    with pytest.raises(ValueError, match="must be C-contiguous"):
        comm.broadcast(FakeArray(8, contiguous=False), timeout=1)
    with pytest.raises(
        ValueError, match="lives on CUDA device 1 but this communicator .* is on device 0"
    ):
        comm.broadcast(FakeArray(8, device=1), timeout=1)
    with pytest.raises(ValueError, match=r"root must be a rank in \[0, 2\), got 2"):
        comm.broadcast(FakeArray(8), root=2, timeout=1)
    assert raw.calls == [], "nothing may reach NCCL for a refused buffer"


def test_close_releases_once_without_waiting_on_peers() -> None:
    # close() frees with ncclCommAbort, never ncclCommDestroy: destroy finalizes with the
    # peers and blocks while the other side's session is still open.
    comm, raw, _ = make_comm()
    comm.close()
    comm.close()
    comm.abort()
    assert names(raw) == ["abort"]
    with pytest.raises(TransferError, match="is closed"):
        comm.warmup(timeout=1)


def test_empty_buffer_skips_nccl_like_nccl_itself() -> None:
    comm, raw, _ = make_comm(complete=False)  # a wait would time out: there must be none
    comm.broadcast(FakeArray(0, ptr=0), timeout=0.5)
    comm.broadcast_typed(FakeArray(0, ptr=0), nccl_dtype=9, count=0, timeout=0.5)
    assert raw.calls == []


def test_device_bytes_pass_through_unresolved_and_are_checked_like_any_buffer() -> None:
    comm, raw, _ = make_comm(complete=False)
    owner = object()
    comm.broadcast(DeviceBytes(0xF000, 256, 0, owner), stream=0x77)
    comm.broadcast_typed(DeviceBytes(0xF100, 64, 0, owner), nccl_dtype=9, count=32, stream=0x77)
    assert raw.calls == [
        ("broadcast", 0xF000, 0xF000, 256, 1, 0, 0x77),
        ("broadcast", 0xF100, 0xF100, 32, 9, 0, 0x77),
    ]
    with pytest.raises(ValueError, match="buffer lives on CUDA device 1 but this communicator"):
        comm.broadcast(DeviceBytes(0xF200, 8, 1, owner), stream=0x77)


def test_slot_buffers_copy_parts_back_to_back_and_reuse_each_slot() -> None:
    from weightwire.backends.device import SlotBuffers

    copies: list[tuple[int, int, int, int, int]] = []
    allocated: list[int] = []

    class Buf:
        def __init__(self, n: int, ptr: int) -> None:
            self.nbytes, self.data = n, SimpleNamespace(ptr=ptr)

        def __getitem__(self, s: slice) -> Buf:
            return Buf(s.stop, self.data.ptr)

    cp = FakeCupy()
    cp.uint8 = "uint8"
    cp.empty = lambda n, dtype: (allocated.append(n), Buf(n, 0x10000 * len(allocated)))[1]
    cp.cuda.runtime.memcpyAsync = lambda dst, src, n, kind, stream: copies.append(
        (dst, src, n, kind, stream)
    )
    cp.cuda.runtime.memcpyDeviceToDevice = 3
    cp.get_default_memory_pool = lambda: SimpleNamespace(free_all_blocks=lambda: None)
    slots = SlotBuffers(cp, 0)
    parts = [
        DeviceBytes(0xA0, 10, 0, None),
        DeviceBytes(0, 0, 0, None),
        DeviceBytes(0xB0, 6, 0, None),
    ]
    out = slots.gather(0, parts, 16, FakeStream(ptr=0x55))
    assert out.nbytes == 16 and copies == [
        (0x10000, 0xA0, 10, 3, 0x55),
        (0x1000A, 0xB0, 6, 3, 0x55),
    ]
    slots.gather(0, parts[:1], 10, FakeStream(ptr=0x55))  # fits: the slot's buffer is reused
    assert allocated == [16] and copies[-1][0] == 0x10000
    slots.gather(0, parts + parts, 32, FakeStream(ptr=0x55))  # grows
    assert allocated == [16, 32] and slots.held_bytes() == 32
    with pytest.raises(ValueError, match="chunk tensors hold 16 bytes, the plan says 17"):
        slots.gather(1, parts, 17, FakeStream())
    with pytest.raises(
        ValueError, match=r"chunk tensors live on CUDA devices \[1\]; the sender packs on device 0"
    ):
        slots.gather(1, [DeviceBytes(0xC0, 4, 1, None)], 4, FakeStream())
    slots.release()
    assert slots.held_bytes() == 0


def test_framework_arrays_become_device_bytes_without_copies() -> None:
    from weightwire.backends.device import array_device_bytes, tensor_device_bytes

    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4)
    x.block_until_ready()
    view = array_device_bytes(x)
    assert (view.ptr, view.nbytes, view.owner) == (x.unsafe_buffer_pointer(), 24, x)
    empty = array_device_bytes(jnp.zeros((0, 4), jnp.float32))
    assert (empty.ptr, empty.nbytes) == (0, 0)

    class CudaTensor:  # the torch surface tensor_device_bytes reads, on "device 1"
        is_cuda, device = True, "cuda:1"

        def __init__(self, contiguous: bool = True) -> None:
            self.contiguous = contiguous

        def is_contiguous(self) -> bool:
            return self.contiguous

        def stride(self) -> tuple[int, ...]:
            return (1, 3)

        def numel(self) -> int:
            return 6

        def element_size(self) -> int:
            return 2

        def data_ptr(self) -> int:
            return 0xBEEF

        def get_device(self) -> int:
            return 1

    t = CudaTensor()
    assert tensor_device_bytes(t) == DeviceBytes(0xBEEF, 12, 1, t)
    with pytest.raises(ValueError, match=r"must be contiguous, got strides \(1, 3\)"):
        tensor_device_bytes(CudaTensor(contiguous=False))
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="is a Tensor on cpu; NCCL needs CUDA"):
        tensor_device_bytes(torch.zeros(2))
