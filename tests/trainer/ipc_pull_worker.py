"""A fake IPC worker in pull mode for the trainer-side tests (``test_ipc_pull.py``): it names
the buffer each chunk goes into on a real control channel and reads each "ready"; its
``misbehave`` knob makes it step out of the protocol in one named way. ``PullCupy`` adds the
IPC handle calls to the fake CUDA runtime and logs every open and close.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.trainer.test_ipc_pipeline import FakeCupy
from weightwire.backends.ipc.channel import Channel
from weightwire.shared.errors import TransferError
from weightwire.shared.info import encode_secret


def handle(n: int) -> str:
    return encode_secret(n.to_bytes(8, "little") * 8)


class PullWorker(threading.Thread):
    """Names buffer ``ids[c]`` for chunk ``c`` (handles on first use), reads each "ready"."""

    def __init__(
        self,
        conn: Any,
        sizes: list[int],
        *,
        ids: list[int] | None = None,
        depth: int = 2,
        release: bool = False,
        misbehave: str = "",
        cap: int = 0,
        early: dict[int, int] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.gate = (
            threading.Event()
        )  # set by the round's begin: a real worker names nothing before the update POST
        self.gate.set()
        self.ch, self.sizes, self.depth, self.release, self.misbehave = (
            Channel(conn, "trainer"),
            sizes,
            depth,
            release,
            misbehave,
        )
        self.ids = ids if ids is not None else list(range(len(sizes)))
        self.cap = cap  # announced capacity (0: the first chunk's size)
        self.named: set[int] = set()
        self.seen: list[dict] = []
        self.early = early or {}  # chunk -> bytes named at the round's start (before any want)
        self.early_ids: list[int] | None = None  # the buffers named early (default: ``ids``)
        self.started = threading.Event()  # set by the round's begin: the start reached this worker

    def handles(self, bid: int, n: int) -> dict[str, Any]:
        if bid in self.named:
            return {}
        self.named.add(bid)
        return {"h": handle(100 + bid), "f": handle(200 + bid), "cap": self.cap or n}

    def want(self, c: int) -> None:
        if self.early.get(c) == self.sizes[c]:
            return  # named early for this size: the trainer fills it unasked
        bid = self.ids[c]
        msg: dict[str, Any] = {"op": "want", "c": c, "b": bid, "n": self.sizes[c]}
        if bid not in self.named or self.misbehave == "reannounce":
            msg.update(h=handle(100 + bid), f=handle(200 + bid), cap=self.cap or self.sizes[c])
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
            if self.early:  # a real worker sends these inside its start
                if not self.started.wait(10):
                    return
                ids = self.early_ids or self.ids
                self.ch.send(
                    {
                        "op": "early",
                        "wants": [
                            {"c": c, "n": n, "b": ids[c], **self.handles(ids[c], n)}
                            for c, n in self.early.items()
                        ],
                    }
                )
            while not self.gate.wait(0.05):
                if self.ch._aborted:
                    return
            posted = 0
            for c in range(len(self.sizes)):
                while posted < len(self.sizes) and posted < c + self.depth:
                    self.want(posted)
                    posted += 1
                self.seen.append(
                    self.ch.expect("ready", deadline=time.monotonic() + 10, what="ready")
                )
            if self.release:
                self.seen.append(
                    self.ch.expect("unmapped", deadline=time.monotonic() + 10, what="unmapped")
                )
        except TransferError:
            return


class PullCupy(FakeCupy):
    def __init__(self, log: list) -> None:
        super().__init__(log)
        rt = self.cuda.runtime
        rt.ipcOpenMemHandle = lambda h, flags: (
            log.append(("open", int.from_bytes(h[:8], "little")))
            or 10_000 * int.from_bytes(h[:8], "little")
        )
        rt.ipcCloseMemHandle = lambda p: log.append(("close", p))
        rt.ipcOpenEventHandle = lambda h: int.from_bytes(h[:8], "little")


def pull_rendezvous(
    monkeypatch: pytest.MonkeyPatch, mode: str, *, packed: bool = True, log: list | None = None
) -> Any:
    """A real ``IPCRendezvous`` for one worker asking for ``mode``, on fake CUDA (``PullCupy``
    logging into ``log``): two slots of 100 bytes, 5 s transfers."""
    from weightwire.backends.ipc import trainer as ipc_trainer

    cupy = PullCupy([] if log is None else log)
    monkeypatch.setattr(ipc_trainer, "cupy_module", lambda: cupy)
    return ipc_trainer.IPCRendezvous(
        world_size=2,
        device=0,
        slot_bytes=100,
        num_slots=2,
        packed=packed,
        timeout_s=5.0,
        release_after_round=False,
        mode=mode,
    )
