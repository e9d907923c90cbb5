"""A worker's ``weightwire_ipc`` session (``IPCReceiver``) and what its links share.

``worker.connect_ipc`` makes the session; the pull link (``worker.IPCPullLink``), the push
link (``push.worker.IPCLink``) and the write-through link receive rounds through it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from weightwire.backends.ipc.channel import Channel
from weightwire.backends.ipc.info import IPCInitInfo
from weightwire.backends.ipc.slots import OpenedSlots, destroy_events, device_uuid
from weightwire.backends.worker_base import ReceiveTurn
from weightwire.shared.errors import TransferError
from weightwire.shared.framing import Chunk


class IPCReceiver:
    """A worker's session: channel, opened slots and ready events, its own free events."""

    def __init__(
        self,
        cp: Any,
        device: int,
        channel: Channel,
        slots: OpenedSlots,
        ready: list[int],
        free: list[int],
        info: IPCInitInfo,
    ) -> None:
        self.cp, self.device, self.channel, self.slots = cp, device, channel, slots
        self.ready, self.free, self.info = ready, free, info
        self._state = "open"

    @property
    def same_gpu(self) -> bool:
        return bool(self.info.device_uuid) and self.info.device_uuid == device_uuid(
            self.cp, self.device
        )

    def alive(self) -> None:
        if self._state != "open":
            raise TransferError(
                f"IPC receive link is {self._state}; call init_weight_transfer_engine again"
            )

    def warmup(self, *, timeout: float) -> None:
        self.channel.expect(
            "ping",
            deadline=time.monotonic() + timeout,
            what="the trainer's warm-up",
            alive=self.alive,
        )
        self.channel.send({"op": "pong"})

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
        self.channel.abort()
        # Mappings stay until close: a copy-out may still be reading them.

    def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self.channel.close()
        self.slots.close()
        destroy_events(self.cp, self.free)
        self.free = []


@dataclass(frozen=True)
class Posted:
    """A posted chunk: the buffer it lands in (``None``: an empty chunk, pull mode)."""

    buffer: Any
    chunk: Chunk
    last: bool
    """The round's last chunk: its end closes what the session releases after a round."""


def posted_chunk(buffer: Any, index: int, turn: ReceiveTurn) -> Posted:
    chunk = turn.chunks[index]
    return Posted(buffer, chunk, chunk.stop == len(turn.metas))
