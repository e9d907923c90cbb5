"""Fakes for the worker's end of ``weightwire_ipc`` on CPU (``test_ipc_pull_worker.py``): a
CUDA runtime that logs allocations, records and waits, and ``connect_scripted``, which runs
``connect_ipc`` against a scripted trainer on a real control channel.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any

import torch

from weightwire.backends.ipc import worker as ipc_worker
from weightwire.backends.ipc.channel import Channel, Listener
from weightwire.backends.ipc.info import IPCInitInfo
from weightwire.shared.info import encode_secret

SECRET = bytes(range(128))


def handle(n: int) -> str:
    return encode_secret(n.to_bytes(8, "little") * 8)


class Runtime:
    CUDARuntimeError = RuntimeError

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._next = 0

    def _new(self) -> int:
        self._next += 1
        return self._next

    def eventCreateWithFlags(self, flags: int) -> int:  # CUDA's names
        return self._new()

    def ipcGetEventHandle(self, e: int) -> bytes:
        return e.to_bytes(8, "little") * 8

    def ipcOpenEventHandle(self, h: bytes) -> int:
        return 1000 + int.from_bytes(h[:8], "little")

    def ipcGetMemHandle(self, p: int) -> bytes:
        return p.to_bytes(8, "little") * 8

    def ipcOpenMemHandle(self, h: bytes, flags: int) -> int:
        self.log.append(("open_slot",))
        return self._new() << 32

    def ipcCloseMemHandle(self, p: int) -> None:
        pass

    def malloc(self, n: int) -> int:
        ptr = self._new() << 32
        self.log.append(("malloc", ptr, n))
        return ptr

    def free(self, p: int) -> None:
        self.log.append(("free", p))

    def eventDestroy(self, e: int) -> None:
        pass

    def eventRecord(self, e: int, s: int) -> None:
        self.log.append(("record", e, s))

    def streamWaitEvent(self, s: int, e: int, flags: int) -> None:
        self.log.append(("wait", s, e))

    def getDeviceProperties(self, i: int) -> dict:
        return {"uuid": b"\x02" * 16}


class Cupy:
    def __init__(self) -> None:
        self.cuda = type("cuda", (), {})()
        self.cuda.runtime = Runtime()
        self.cuda.Device = lambda i: nullcontext()


def session_info(port: int, *, packed: bool = True, release: bool = False) -> IPCInitInfo:
    """A worker's init info for the trainer listening on ``port``: two ring slots of 100 bytes."""
    return IPCInitInfo(
        host="127.0.0.1",
        port=port,
        secret_b64=encode_secret(SECRET),
        rank_offset=1,
        world_size=2,
        mem_handles_b64=[handle(5), handle(6)],
        event_handles_b64=[handle(1), handle(2)],
        packed=packed,
        packed_buffer_size_bytes=100,
        packed_num_buffers=2,
        timeout_s=5.0,
        release_after_round=release,
    )


def connect_scripted(trainer_script: Any, **info_kw: Any) -> tuple[Any, Channel, dict]:
    """``connect_ipc`` against a trainer whose join + warm-up is
    ``trainer_script(channel, hello)``; the worker's link, the trainer's channel, the hello."""
    listener = Listener("127.0.0.1", SECRET)
    box: dict = {}

    def trainer() -> None:
        (ch,) = listener.accept(1, timeout=10)
        box["ch"] = ch
        box["hello"] = ch.expect("hello", deadline=time.monotonic() + 5, what="hello")
        trainer_script(ch, box["hello"])

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        link = ipc_worker.connect_ipc(
            session_info(listener.address[1], **info_kw), rank=1, device=torch.device("cuda", 0)
        )
    finally:
        thread.join(10)
        listener.close()
    return link, box["ch"], box["hello"]
