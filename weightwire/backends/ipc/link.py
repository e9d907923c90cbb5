"""``IPCSenderComm``: rank 0's joined ``weightwire_ipc`` link (slots, channels, free events).

``backends.ipc.trainer.IPCRendezvous`` makes one; the two data paths
(``ipc.pipeline.IPCPipeline``, ``ipc.pull.IPCPullPipeline``) move rounds through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from weightwire.backends.ipc.channel import Channel
from weightwire.backends.ipc.slots import IPCSlots, destroy_events, device_uuid
from weightwire.shared.errors import TransferError


class IPCSenderComm:
    """Rank 0 of an IPC group: the slots, one channel and the free events per worker."""

    def __init__(
        self,
        cp: Any,
        slots: IPCSlots,
        channels: list[Channel],
        free_events: list[list[int]],
        peer_uuids: list[str],
        release_after_round: bool,
        mode: str = "push",
    ) -> None:
        self.cp, self.slots, self.channels, self.free_events = cp, slots, channels, free_events
        self.peer_uuids = peer_uuids
        self.mode = mode
        self.release_after_round = release_after_round
        self._state = "open"
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1 + len(self.channels)

    @property
    def same_gpu(self) -> list[bool]:
        """Per worker: does it run on the trainer's GPU (False: a peer GPU of this host)?"""
        mine = device_uuid(self.cp, self.slots.device)
        return [bool(mine) and u == mine for u in self.peer_uuids]

    def alive(self) -> None:
        if self._state != "open":
            raise TransferError(f"IPC communicator is {self._state}; call trainer_init again")

    def warmup(self, *, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (60.0 if timeout is None else timeout)
        for ch in self.channels:
            ch.send({"op": "ping"})
        for ch in self.channels:
            ch.expect("pong", deadline=deadline, what="the warm-up answer", alive=self.alive)

    def abort(self) -> None:
        self._end("aborted", lambda ch: ch.abort())

    def close(self) -> None:
        self._end("closed", lambda ch: ch.close())

    def _end(self, state: str, end: Callable[[Channel], None]) -> None:
        """The first of abort / close ends every channel its way; a later one does nothing."""
        with self._lock:
            if self._state != "open":
                return
            self._state = state
        for ch in self.channels:
            end(ch)

    def release(self) -> None:
        """Free the slots and events.

        Called after the fill stream was synchronized or the session ended.
        """
        self.slots.destroy()
        for events in self.free_events:
            destroy_events(self.cp, events)
        self.free_events = []
