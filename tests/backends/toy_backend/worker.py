"""The worker's end of the toy ``toy_files`` backend: poll for each chunk's file, read it."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import torch

from tests.backends.toy_backend.info import ToyFilesInitInfo, chunk_path, ready_path
from weightwire.backends.receiving import ChunkedLink
from weightwire.backends.worker_base import ReceiveTurn
from weightwire.shared.errors import TransferError, TransferTimeout
from weightwire.shared.waiting import poll_until

_POLL_S = 0.01


def connect_files(info: ToyFilesInitInfo, *, rank: int, device: torch.device) -> FilesLink:
    """Join: say ready with a file rank 0's rendezvous waits for."""
    if not os.path.isdir(info.dir):
        raise TransferError(
            f"toy_files: the trainer's directory {info.dir} does not exist "
            "(not a shared file system?)"
        )
    tmp = os.path.join(info.dir, f".ready.{rank}.tmp")
    with open(tmp, "w"):
        pass
    os.replace(tmp, ready_path(info.dir, rank))
    return FilesLink(
        info.dir, device=device, timeout_s=info.timeout_s, depth=info.packed_num_buffers
    )


class FilesLink(ChunkedLink):
    """Chunk ``i`` of the session is file ``seq``: the link counts broadcasts as rank 0 does."""

    def __init__(
        self, directory: str, *, device: torch.device, timeout_s: float, depth: int
    ) -> None:
        super().__init__(device=device, timeout_s=timeout_s, depth=depth)
        self.directory = directory
        self._seq = 0
        self._posted: dict[int, tuple[int, int]] = {}  # chunk index -> (seq, nbytes)
        self._aborted = threading.Event()

    def post(self, index: int, turn: ReceiveTurn) -> None:
        self._posted[index] = (self._seq, turn.chunks[index].nbytes)
        self._seq += 1

    def wait(self, index: int) -> Any:
        seq, nbytes = self._posted.pop(index)
        path = chunk_path(self.directory, seq)

        def check() -> None:
            if self._aborted.is_set():
                raise TransferError(f"toy_files link was aborted while waiting for {path}")

        poll_until(
            lambda: os.path.exists(path),
            deadline=time.monotonic() + self.timeout_s,
            check=check,
            max_sleep_s=_POLL_S,
            expired=lambda: TransferTimeout(
                f"toy_files: chunk file {path} did not appear within {self.timeout_s:g} s"
            ),
        )
        data = np.fromfile(path, dtype=np.uint8)
        if data.nbytes != nbytes:
            raise TransferError(
                f"toy_files: {path} holds {data.nbytes} bytes, the plan says {nbytes}"
            )
        return torch.from_numpy(data).to(self.device)

    def peer_closed(self) -> bool:
        return not os.path.isdir(self.directory)

    def abort(self) -> None:
        self._aborted.set()

    def close(self) -> None:
        self._posted.clear()
