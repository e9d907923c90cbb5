"""``weightwire_ipc`` without a GPU: the init info's validation, the control channel's
failure paths (dead peer, silence, garbage, a round out of step) and the backend's
registration. The GPU paths are in ``tests/gpu/test_ipc_gpu.py``."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from weightwire import backends
from weightwire.backends import get_backend
from weightwire.backends.ipc.channel import Channel, Listener, check_int, dial
from weightwire.backends.ipc.info import IPC_HANDLE_BYTES, IPCInitInfo
from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout
from weightwire.shared.info import encode_secret
from weightwire.trainer.config import TrainerInitInfo

SECRET = encode_secret(bytes(range(128)))
HANDLE = encode_secret(bytes(range(IPC_HANDLE_BYTES)))


def ipc(**over: object) -> dict:
    base = {
        "host": "127.0.0.1",
        "port": 4242,
        "secret_b64": SECRET,
        "rank_offset": 1,
        "world_size": 2,
        "mem_handles_b64": [HANDLE, HANDLE],
        "event_handles_b64": [HANDLE, HANDLE],
        "device_uuid": "ab12",
        "packed_buffer_size_bytes": 1 << 20,
        "packed_num_buffers": 2,
        "timeout_s": 5.0,
    }
    return {**base, **over}


def test_ipc_init_info_round_trips_as_json_and_hides_secrets() -> None:
    info = IPCInitInfo.from_dict(ipc(release_after_round=True))
    assert IPCInitInfo.from_json(info.to_json()) == info
    assert info.mem_handles == [bytes(range(IPC_HANDLE_BYTES))] * 2 and info.release_after_round
    assert backends.init_info_type("weightwire_ipc") is IPCInitInfo
    text = repr(info)
    assert SECRET not in text and HANDLE not in text and "<redacted>" in text
    json.dumps(info.to_dict())  # JSON only: nothing pickled, nothing binary


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (ipc(mem_handles_b64=[HANDLE]), "mem_handles_b64 must list one handle per slot (2), got 1"),
        (
            ipc(event_handles_b64=[HANDLE, HANDLE, HANDLE]),
            "event_handles_b64 must list one handle per slot",
        ),
        (ipc(mem_handles_b64=[HANDLE, encode_secret(b"x" * 63)]), "mem_handles_b64[1]"),
        (ipc(mem_handles_b64=[HANDLE, 7]), "mem_handles_b64[1] must be a base64 string"),
        (ipc(mem_handles_b64="AAAA"), "mem_handles_b64 must be list"),
        (ipc(secret_b64=encode_secret(b"s" * 16)), "secret_b64"),
        (ipc(device_uuid="GPU-<script>"), "device_uuid"),
        (
            ipc(packed_num_buffers=0, mem_handles_b64=[], event_handles_b64=[]),
            "packed_num_buffers must be an int in",
        ),
        (ipc(port=0), "port must be in [1, 65535]"),
        (ipc(timeout_s=0), "timeout_s"),
        (ipc(release_after_round="yes"), "release_after_round must be bool"),
        (ipc(handles=[HANDLE]), "unknown keys ['handles']"),
    ],
)
def test_ipc_init_info_refuses_bad_payloads_by_field(body: dict, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        IPCInitInfo.from_dict(body)
    assert needle in str(err.value)


def test_backend_is_registered_on_device_and_knob_is_checked() -> None:
    backend = get_backend("weightwire_ipc")
    assert backend.caps.on_device and backend.name == "weightwire_ipc"
    assert TrainerInitInfo(
        backend="weightwire_ipc", ipc_release_after_round=True
    ).ipc_release_after_round
    with pytest.raises(ValueError, match="ipc_release_after_round must be a bool"):
        TrainerInitInfo(backend="weightwire_ipc", ipc_release_after_round=1)  # type: ignore[arg-type]
    assert TrainerInitInfo(backend="weightwire_ipc").ipc_mode == "auto"
    assert TrainerInitInfo(backend="weightwire_ipc", ipc_mode="push").ipc_mode == "push"
    with pytest.raises(
        ValueError,
        match="ipc_mode must be one of .pull., .push., .write_through., .auto., got .copy.",
    ):
        TrainerInitInfo(backend="weightwire_ipc", ipc_mode="copy")


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a, "peer A"), Channel(b, "peer B")


def test_channel_carries_json_messages_both_ways() -> None:
    a, b = _pair()
    a.send({"op": "ready", "c": 0, "s": 1, "o": 0, "n": 4})
    msg = b.expect("ready", deadline=time.monotonic() + 5, what="a piece")
    assert msg == {"op": "ready", "c": 0, "s": 1, "o": 0, "n": 4}
    b.send({"op": "free", "s": 1})
    assert a.recv(deadline=time.monotonic() + 5, what="a release")["s"] == 1


def test_channel_reports_a_dead_peer_as_peer_lost() -> None:
    a, b = _pair()
    b.abort()  # the peer's end closes, as when its process dies
    with pytest.raises(
        PeerLost, match="peer A closed the IPC control channel while this side waited for a piece"
    ):
        a.recv(deadline=time.monotonic() + 5, what="a piece")


def test_channel_wait_is_bounded() -> None:
    a, _b = _pair()
    with pytest.raises(
        TransferTimeout, match="a release from peer A did not arrive within the timeout"
    ):
        a.recv(deadline=time.monotonic() + 0.05, what="a release")


def test_channel_refuses_garbage_and_out_of_step_messages() -> None:
    a, b = _pair()
    b.send_raw(b"\x80not json", "junk")
    with pytest.raises(TransferError, match="not JSON"):
        a.recv(deadline=time.monotonic() + 5, what="x")
    b.send_raw(b"[1, 2]", "junk")
    with pytest.raises(TransferError, match="without an 'op'"):
        a.recv(deadline=time.monotonic() + 5, what="x")
    b.send({"op": "free", "s": 0})
    with pytest.raises(
        TransferError, match="sent 'free' where the worker's hello \\('hello'\\) was due"
    ):
        a.expect("hello", deadline=time.monotonic() + 5, what="the worker's hello")
    with pytest.raises(TransferError, match="with s=9, outside \\[0, 1\\]"):
        check_int({"op": "free", "s": 9}, "s", 0, 1, "peer B")
    with pytest.raises(TransferError, match="with s=True"):
        check_int({"op": "free", "s": True}, "s", 0, 1, "peer B")


def test_channel_abort_from_another_thread_wakes_a_waiter() -> None:
    a, _b = _pair()
    waiting = threading.Event()

    def alive() -> None:
        waiting.set()

    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            a.recv(deadline=time.monotonic() + 30, what="a piece", alive=alive)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(10)
    a.abort()
    thread.join(10)
    assert not thread.is_alive()
    assert isinstance(errors[0], TransferError) and "aborted" in str(errors[0])


def test_channel_refuses_an_oversized_frame_before_reading_it() -> None:
    a, b = _pair()
    b._sock.sendall((1 << 30).to_bytes(4, "big"))
    with pytest.raises(TransferError, match="1073741824-byte control message, over the limit"):
        a.recv(deadline=time.monotonic() + 5, what="x")


def _dial_in_thread(port: int, secret: bytes, out: list) -> threading.Thread:
    def run() -> None:
        try:
            out.append(dial("127.0.0.1", port, secret, timeout=10, peer="the trainer"))
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_handshake_admits_the_secret_holder_and_refuses_a_stray_client() -> None:
    secret = bytes(range(128))
    listener = Listener("127.0.0.1", secret)
    port = listener.address[1]
    stray: list = []
    good: list = []
    t1 = _dial_in_thread(
        port, b"w" * 128, stray
    )  # wrong secret: refused, the listener keeps waiting
    t1.join(10)
    t2 = _dial_in_thread(port, secret, good)
    (trainer_side,) = listener.accept(1, timeout=10)
    t2.join(10)
    listener.close()
    assert isinstance(stray[0], TransferError), stray
    worker_side = good[0]
    assert isinstance(worker_side, Channel)
    worker_side.send({"op": "hello", "rank": 1})
    assert trainer_side.expect("hello", deadline=time.monotonic() + 5, what="hello")["rank"] == 1


def test_worker_refuses_a_trainer_that_cannot_prove_the_secret() -> None:
    listener = Listener("127.0.0.1", b"t" * 128)  # a listener with another secret
    out: list = []
    thread = _dial_in_thread(listener.address[1], b"w" * 128, out)
    with pytest.raises(TransferTimeout, match="1 of 1 worker\\(s\\) did not join"):
        listener.accept(1, timeout=0.5)  # it refuses the worker's proof too
    thread.join(10)
    listener.close()
    assert isinstance(out[0], (TransferError,)), out


def test_accept_is_bounded_and_cancellable() -> None:
    listener = Listener("127.0.0.1", b"s" * 128)
    with pytest.raises(
        TransferTimeout, match="IPC rendezvous: 2 of 2 worker\\(s\\) did not join within"
    ):
        listener.accept(2, timeout=0.1)
    errors: list = []
    thread = threading.Thread(
        target=lambda: errors.append(pytest.raises(TransferError, listener.accept, 1, timeout=30))
    )
    thread.start()
    listener.close()  # the init request failed: the join must end now, not at its timeout
    thread.join(10)
    assert not thread.is_alive() and "cancelled" in str(errors[0].value)
