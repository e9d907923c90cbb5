"""Rank 0's side of the toy ``toy_files`` backend: a fresh directory per session.

``open`` makes the directory and posts it; ``join`` waits for every worker's ready file;
the generic ``HostPipeline`` broadcasts through ``FilesComm``, which writes each chunk
as one file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any, ClassVar

import numpy as np

from tests.backends.toy_backend.info import ToyFilesInitInfo, chunk_path, ready_path
from tests.backends.toy_backend.spec import TOY_FILES
from weightwire.backends.base import (
    Backend,
    Rendezvous,
    RoundSender,
    SenderCaps,
    SenderParts,
    SenderSettings,
)
from weightwire.backends.pipelines import host_sender
from weightwire.shared.errors import TransferError, TransferTimeout
from weightwire.shared.waiting import poll_until

_POLL_S = 0.01
"""Longest sleep between two looks at the directory."""


class FilesComm:
    """Rank 0's end (a ``Communicator`` and the trainer's ``Link``): one file per broadcast."""

    def __init__(self, directory: str, world_size: int) -> None:
        self.directory = directory
        self._world_size = world_size
        self._seq = 0
        self._aborted = threading.Event()

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return self._world_size

    def warmup(self, *, timeout: float | None = None) -> None:
        """Nothing to warm: ``join`` already saw every worker's ready file."""

    def broadcast(
        self, buffer: Any, *, root: int = 0, timeout: float | None = None, stream: Any = None
    ) -> None:
        if self._aborted.is_set():
            raise TransferError(f"toy_files link to {self.directory} was aborted")
        parts: list[np.ndarray] = buffer if isinstance(buffer, list) else [buffer]
        seq, self._seq = self._seq, self._seq + 1
        self._publish(seq, parts)

    def _publish(self, seq: int, parts: list[np.ndarray]) -> None:
        # A reader polls for the final name: it must never see a half-written file.
        tmp = os.path.join(self.directory, f".{seq}.tmp")
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(np.ascontiguousarray(part).data)
        os.replace(tmp, chunk_path(self.directory, seq))

    def abort(self) -> None:
        self._aborted.set()
        self.close()

    def close(self) -> None:
        # Removing the directory is also how workers learn the trainer is gone (peer_closed).
        shutil.rmtree(self.directory, ignore_errors=True)


class _FilesRendezvous(Rendezvous):
    def __init__(self, payload: dict[str, Any], comm: FilesComm) -> None:
        super().__init__(payload)
        self._comm = comm
        self._cancelled = threading.Event()

    def join(self, *, timeout: float) -> FilesComm:
        comm = self._comm
        ranks = range(1, comm.world_size)

        def missing() -> list[int]:
            return [r for r in ranks if not os.path.exists(ready_path(comm.directory, r))]

        def check() -> None:
            if self._cancelled.is_set():
                raise TransferError("toy_files rendezvous was cancelled")

        try:
            poll_until(
                lambda: not missing(),
                deadline=time.monotonic() + timeout,
                check=check,
                max_sleep_s=_POLL_S,
                expired=lambda: TransferTimeout(
                    f"toy_files: worker rank(s) {missing()} did not join "
                    f"{comm.directory} within {timeout:.0f} s"
                ),
            )
        except BaseException:
            comm.abort()
            raise
        return comm

    def cancel(self) -> None:
        self._cancelled.set()


class ToyFilesBackend(Backend):
    """``toy_files``: chunks travel as files in a directory trainer and workers share."""

    name: ClassVar[str] = TOY_FILES.name
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=False)

    def open(self, settings: SenderSettings, *, world_size: int) -> Rendezvous:
        directory = tempfile.mkdtemp(prefix="weightwire-toy-files-")
        payload = ToyFilesInitInfo(
            dir=directory,
            rank_offset=1,
            world_size=world_size,
            packed=settings.packed,
            packed_buffer_size_bytes=settings.packed_buffer_size_bytes,
            packed_num_buffers=settings.packed_num_buffers,
            timeout_s=float(settings.timeouts.transfer_s),
            stage_budget_bytes=settings.stage_budget_bytes,
        ).to_dict()
        return _FilesRendezvous(payload, FilesComm(directory, world_size))

    def sender(self, link: Any, settings: SenderSettings, parts: SenderParts) -> RoundSender:
        return host_sender(link, settings, parts)
