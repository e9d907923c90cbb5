"""Joining an NCCL group with a bound: the unique id's two forms, the join arguments, and
``ncclCommInitRank`` on a daemon thread that ``init_rank`` gives up on after ``timeout``.

NCCL's init waits forever for a missing peer, and CuPy 14's ``NcclConfig`` has no
``blocking`` field, so a stuck init cannot be interrupted: the thread stays parked in
NCCL (a bootstrap socket, no GPU work) and a communicator that a late peer still
completes is aborted at once (``_InitBox``): none is ever leaked live.
"""

from __future__ import annotations

import threading
from contextlib import suppress
from typing import Any

from weightwire.backends.nccl.info import NCCL_UNIQUE_ID_BYTES
from weightwire.shared.errors import TransferError, TransferTimeout


def unique_id_to_bytes(raw: object) -> bytes:
    """Normalize ``get_unique_id()`` output: bytes (CuPy >= 14) or a tuple of signed chars."""
    if isinstance(raw, (bytes, bytearray)):
        out = bytes(raw)
    elif isinstance(raw, (tuple, list)) and all(type(x) is int and -128 <= x <= 255 for x in raw):
        out = bytes(x & 0xFF for x in raw)
    else:
        raise TypeError(f"unexpected NCCL unique id type {type(raw).__name__}")
    if len(out) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id must be {NCCL_UNIQUE_ID_BYTES} bytes, got {len(out)}")
    return out


def unique_id_to_signed_tuple(uid: bytes) -> tuple[int, ...]:
    """The tuple form CuPy < 14 takes: ``char`` is signed, so bytes >= 128 become negative."""
    return tuple(b - 256 if b >= 128 else b for b in uid)


def check_join_args(unique_id: object, rank: object, world_size: object, timeout: object) -> bytes:
    if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        got = (
            f"{len(unique_id)} bytes"
            if isinstance(unique_id, (bytes, bytearray))
            else type(unique_id).__name__
        )
        raise ValueError(f"unique_id must be {NCCL_UNIQUE_ID_BYTES} bytes, got {got}")
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    check_seconds(timeout)
    return bytes(unique_id)


def check_seconds(timeout: object) -> float:
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < float("inf")
    ):
        raise ValueError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    return float(timeout)


class _InitBox:
    """Hand-off between the init thread and ``join``: whichever side loses the race
    (a late init after a timeout) cleans up, so no communicator is ever leaked live."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.comm: Any = None
        self.error: BaseException | None = None
        self.abandoned = False

    def finish(self, comm: Any, error: BaseException | None) -> None:
        with self.lock:
            late = self.abandoned
            if not late:
                self.comm, self.error = comm, error
        if late and comm is not None:
            with suppress(Exception):  # nobody is left to tell
                comm.abort()
        self.done.set()

    def abandon(self) -> bool:
        """Mark abandoned unless a result already arrived (then False: use it)."""
        with self.lock:
            if self.comm is not None or self.error is not None:
                return False
            self.abandoned = True
            return True


def _init_in_thread(
    box: _InitBox, cp: Any, nccl: Any, uid: bytes, rank: int, world_size: int, device: int
) -> None:
    comm, error = None, None
    try:
        # The CUDA current device is per thread; NCCL binds the communicator to it.
        cp.cuda.Device(device).use()
        try:
            comm = nccl.NcclCommunicator(world_size, uid, rank)
        except TypeError:
            # CuPy < 14 takes the id as a tuple of signed chars. The type check fails
            # before NCCL is entered, so retrying cannot double-join.
            comm = nccl.NcclCommunicator(world_size, unique_id_to_signed_tuple(uid), rank)
    except BaseException as exc:
        error = exc
    box.finish(comm, error)


def init_rank(
    cp: Any, nccl: Any, uid: bytes, *, rank: int, world_size: int, device: int, timeout: float
) -> Any:
    """CuPy's ``NcclCommunicator`` for ``rank`` on ``device``, once every rank joined;
    ``TransferTimeout`` after ``timeout`` s, ``TransferError`` if NCCL's init failed."""
    box = _InitBox()
    threading.Thread(
        target=_init_in_thread,
        args=(box, cp, nccl, uid, rank, world_size, device),
        name=f"weightwire-nccl-init-rank{rank}",
        daemon=True,
    ).start()
    if not box.done.wait(timeout) and box.abandon():
        raise TransferTimeout(
            f"NCCL rendezvous timed out after {timeout:g} s: "
            f"rank {rank} of world size {world_size} "
            f"(CUDA device {device}) waited in ncclCommInitRank for peers that never joined; every "
            f"rank must join with the same unique id at the same time"
        )
    box.done.wait()  # the result is in (or arriving): finish() sets done right after storing it
    if box.error is not None:
        raise TransferError(
            f"NCCL init failed for rank {rank} of world size {world_size} "
            f"on CUDA device {device}: {box.error}"
        ) from box.error
    return box.comm
