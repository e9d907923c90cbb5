"""Peer processes for the TCP tests (holds no tests itself).

Run as ``python test_tcp_peer.py recv|send`` with a JSON config on stdin (the secret
never goes on argv); it prints one JSON object per line: progress events
(``{"event": ...}``) and a final result (``{"ok": ...}``). Receivers report sha256
digests of what they unpacked, never the bytes. ``Peer`` drives one from a test.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from weightwire.shared.errors import TransferError
from weightwire.shared.framing import plan, unpack_host
from weightwire.shared.meta import ParamMeta


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()


class Peer:
    """A peer subprocess with a line-buffered JSON event stream; always bounded waits."""

    def __init__(self, role: str, config: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(config))
        self.proc.stdin.close()
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._pump, daemon=True),
            threading.Thread(
                target=lambda: self._stderr.extend(self.proc.stderr or ()), daemon=True
            ),
        ]
        for reader in self._readers:
            reader.start()

    def _pump(self) -> None:
        for line in self.proc.stdout or ():
            self._events.put(json.loads(line))
        self._events.put(None)

    def next(self, timeout: float = 60) -> dict[str, Any]:
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"peer sent nothing within {timeout} s; stderr: {''.join(self._stderr)[-2000:]}"
            ) from None
        if event is None:
            self.proc.wait(timeout=10)
            stderr = "".join(self._stderr)[-2000:]
            raise AssertionError(f"peer exited ({self.proc.returncode}) early; stderr: {stderr}")
        return event

    def expect(self, event: str, timeout: float = 60) -> dict[str, Any]:
        got = self.next(timeout)
        assert got.get("event") == event, got
        return got

    def result(self, timeout: float = 60) -> dict[str, Any]:
        while "ok" not in (got := self.next(timeout)):
            pass
        self.proc.wait(timeout=timeout)
        return got

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for reader in self._readers:  # the pipes hit EOF once the process is gone
            reader.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


class Peers(list[Peer]):
    """Context manager that kills every peer it holds on exit, test passed or not."""

    def spawn(self, role: str, config: dict[str, Any]) -> Peer:
        peer = Peer(role, config)
        self.append(peer)
        return peer

    def __enter__(self) -> Peers:
        return self

    def __exit__(self, *exc: object) -> None:
        for peer in self:
            peer.kill()


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _recv(cfg: dict[str, Any]) -> None:
    from weightwire.backends.tcp.comm import TCPCommunicator

    comm = TCPCommunicator.connect(
        host=cfg["host"],
        port=cfg["port"],
        secret=base64.b64decode(cfg["secret_b64"]),
        rank=cfg["rank"],
        world_size=cfg["world_size"],
        timeout=cfg.get("timeout", 30),
        transfer_timeout=cfg.get("transfer_timeout", 60),
    )
    try:
        comm.warmup(timeout=cfg.get("timeout", 30))
        _emit({"event": "warm"})
        if cfg.get("stall"):  # connected and warm, never reads: the sender must notice
            time.sleep(600)
        if "go_file" in cfg:  # reads only once the test says so (it writes the file)
            deadline = time.monotonic() + 60
            while not os.path.exists(cfg["go_file"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{cfg['go_file']} did not appear within 60 s")
                time.sleep(0.01)
        metas = [ParamMeta.from_dict(m) for m in cfg["metas"]]
        chunks = plan(metas, packed=cfg["packed"], buffer_size_bytes=cfg["buffer_size"])
        buf = np.empty(
            max((c.nbytes for c in chunks), default=0), dtype=np.uint8
        )  # preallocated once
        digests = {}
        for chunk in chunks:
            comm.broadcast(buf[: chunk.nbytes])
            for name, array in unpack_host(buf, metas, chunk, copy=False):
                digests[name] = digest(array)
        _emit({"ok": True, "digests": digests})
    except TransferError as exc:
        _emit({"ok": False, "type": type(exc).__name__, "error": str(exc)})
    finally:
        comm.close()


def _send(cfg: dict[str, Any]) -> None:
    from weightwire.backends.tcp.rendezvous import TCPRendezvous

    rendezvous = TCPRendezvous(world_size=cfg["world_size"])
    _emit({"event": "listening", **rendezvous.init_fields()})
    comm = rendezvous.accept(timeout=cfg.get("timeout", 30))
    comm.warmup(timeout=cfg.get("timeout", 30))
    data = np.ones(cfg["nbytes"], dtype=np.uint8)
    _emit({"event": "sending"})
    try:
        comm.broadcast(data, timeout=cfg.get("transfer_timeout", 60))
        _emit({"ok": True})
    except TransferError as exc:
        _emit({"ok": False, "type": type(exc).__name__, "error": str(exc)})


if __name__ == "__main__":
    {"recv": _recv, "send": _send}[sys.argv[1]](json.loads(sys.stdin.read()))
