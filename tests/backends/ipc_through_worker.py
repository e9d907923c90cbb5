"""A fake IPC worker in write-through mode for the trainer-side tests
(``test_ipc_write_through.py``): it offers its landing table (or refuses, naming why) the
first time, then answers each round's ``go`` with ``done``; a refused or declined worker asks
for its chunks as in pull mode.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.trainer.ipc_pull_worker import handle
from weightwire.backends.ipc.channel import Channel
from weightwire.backends.ipc.through.table import LandingTable, refusal_message, table_messages
from weightwire.shared.errors import TransferError
from weightwire.shared.meta import ParamMeta


class ThroughWorker(threading.Thread):
    """Each round: ``land`` (table or refusal) the first time, then ``go`` and ``done``; a
    refused or declined worker asks for its chunks as in pull mode."""

    def __init__(self, conn: Any, metas: list[ParamMeta], table: LandingTable | None) -> None:
        super().__init__(daemon=True)
        self.ch = Channel(conn, "trainer")
        self.metas, self.table = metas, table
        self.rounds = 1
        self.seen: list[dict[str, Any]] = []
        self.offered = False
        self.go_table = 0
        self.early = False  # the go comes at the round's start, before the update
        self.started = threading.Semaphore(0)  # released by each round's begin (its start)

    def run(self) -> None:
        try:
            for _ in range(self.rounds):
                self._round()
        except TransferError as exc:
            self.seen.append({"op": "error", "why": str(exc)})

    def _expect(self, op: str) -> dict[str, Any]:
        msg = self.ch.expect(op, deadline=time.monotonic() + 10, what=op)
        self.seen.append(msg)
        return msg

    def _round(self) -> None:
        if not self.started.acquire(timeout=10):
            return
        through = True
        if self.early and self.offered:
            self.ch.send({"op": "go", "t": self.go_table, "early": True})
            self._expect("done")
            return
        if not self.offered:
            self.offered = True
            if self.table is None:
                self.ch.send(refusal_message(0, "lm_head is quantized"))
                through = False
            else:
                for msg in table_messages(self.table, 0):
                    self.ch.send(msg)
                through = self._expect("path")["wt"]
        if not through:
            want = {"op": "want", "c": 0, "b": 0, "n": 40, "cap": 40}
            self.ch.send({**want, "h": handle(100), "f": handle(200)})
            self._expect("ready")
            return
        self.ch.send({"op": "go", "t": self.go_table})
        self._expect("done")
