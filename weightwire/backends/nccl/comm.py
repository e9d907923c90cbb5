"""NCCL data plane through CuPy's NCCL binding (imported lazily; any CuPy wheel name).

Ranks join one communicator from a 128-byte unique id, run the one-element float32
SUM all-reduce a vLLM worker issues right after init, then broadcast device buffers.
NCCL has no timeouts (init waits forever for a missing peer, a collective spins
forever on a dead one), so every wait here is bounded:

* ``join`` runs the blocking init in a daemon thread and gives up after ``timeout``
  (``backends.nccl.join.init_rank``).
  CuPy 14's ``NcclConfig`` has no ``blocking`` field, so a stuck init cannot be
  interrupted: the thread stays parked in NCCL (a bootstrap socket, no GPU work) and
  a communicator that a late peer still completes is aborted at once.
* ``synchronize`` polls an event; on timeout or an async NCCL error it calls
  ``ncclCommAbort`` (the spinning kernels exit) and raises.

One thread drives a communicator; ``abort()`` may come from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np

from weightwire.backends.device import DeviceBytes, event_done, resolve_buffer, stream_pointer
from weightwire.backends.nccl.join import check_join_args, check_seconds, init_rank
from weightwire.backends.nccl.library import (
    NCCL_FLOAT32,
    NCCL_ITEMSIZE,
    NCCL_SUM,
    NCCL_UINT8,
    format_nccl_version,
    load_nccl,
)
from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.waiting import poll_until

_NCCL_REMOTE_ERROR = 6

# A wait polls (``shared.waiting``), spinning long enough to cover a whole large round
# (a sleep's wake-up latency would cost several percent of a 45 ms 16 GB transfer);
# NCCL's asynchronous errors are asked for far less often.
_ASYNC_CHECK_EVERY_S = 0.01


class NCCLCommunicator:
    """One rank of an NCCL broadcast group (implements ``shared.communicator.Communicator``)."""

    def __init__(
        self, comm: Any, *, rank: int, world_size: int, device: int, cp: Any, version: str
    ) -> None:
        """Wrap an initialized CuPy ``NcclCommunicator``; use ``join`` to make one."""
        self._comm = comm
        self._rank, self._world_size, self.device, self.version = rank, world_size, device, version
        self._cp = cp
        self._lock = threading.Lock()
        self._state = "open"
        self._reason = ""
        self._stream: Any = None
        self._external: dict[int, Any] = {}
        self._inflight: dict[int, list[Any]] = {}

    @classmethod
    def join(
        cls,
        *,
        unique_id: bytes,
        rank: int,
        world_size: int,
        device: int | None = None,
        timeout: float,
    ) -> NCCLCommunicator:
        """Enter ``ncclCommInitRank`` as ``rank`` of ``world_size`` on CUDA ``device``
        (default: the current one). Every rank must enter concurrently; if they have not
        all arrived within ``timeout`` seconds this raises ``TransferTimeout``."""
        uid = check_join_args(unique_id, rank, world_size, timeout)
        cp, nccl = load_nccl()
        count = int(cp.cuda.runtime.getDeviceCount())
        if device is None:
            device = int(cp.cuda.runtime.getDevice())
        if type(device) is not int or not 0 <= device < count:
            raise ValueError(f"device must be a CUDA device index in [0, {count}), got {device!r}")
        version = format_nccl_version(int(nccl.get_version()))
        raw = init_rank(
            cp, nccl, uid, rank=rank, world_size=world_size, device=device, timeout=timeout
        )
        return cls(raw, rank=rank, world_size=world_size, device=device, cp=cp, version=version)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def cupy(self) -> Any:
        """The CuPy module this communicator drives (the data path's buffers use it too)."""
        return self._cp

    @property
    def cupy_communicator(self) -> Any:
        """The underlying CuPy ``NcclCommunicator`` (benchmarks' raw baseline). Calls made
        on it directly bypass every timeout and check of this class."""
        return self._live()

    def __repr__(self) -> str:
        return (
            f"NCCLCommunicator(rank={self._rank}, world_size={self._world_size}, "
            f"device={self.device}, "
            f"nccl={self.version}, state={self._state})"
        )

    # -- helpers ---------------------------------------------------------------------------

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        with self._cp.cuda.Device(self.device):
            yield

    def _where(self) -> str:
        return f"rank {self._rank} of world size {self._world_size}"

    def _live(self) -> Any:
        """The CuPy communicator, or ``TransferError`` once aborted/closed (by any thread)."""
        comm = self._comm
        if self._state != "open" or comm is None:
            raise TransferError(
                f"NCCL communicator ({self._where()}) is {self._state}{self._reason}; "
                "join a new one"
            )
        return comm

    def _fail(self, exc: TransferError) -> TransferError:
        """Abort (never waits on peers) and hand back ``exc`` for the caller to raise."""
        self._abort(f": {exc}")
        return exc

    def _cupy_stream(self, stream: Any) -> Any:
        cp = self._cp
        if stream is None:
            if self._stream is None:
                with self._on_device():
                    self._stream = cp.cuda.Stream(non_blocking=True)
            return self._stream
        if isinstance(stream, (cp.cuda.Stream, cp.cuda.ExternalStream)):
            return stream
        ptr = stream_pointer(stream)
        if ptr not in self._external:
            self._external[ptr] = cp.cuda.ExternalStream(ptr, self.device)
        return self._external[ptr]

    # -- Communicator API ------------------------------------------------------------------

    def warmup(self, *, timeout: float | None = None) -> None:
        """The one-element float32 SUM all-reduce every vLLM worker issues right after init.

        Must precede any broadcast, or every rank deadlocks in mismatched collectives."""
        comm = self._live()
        stream = self._cupy_stream(None)
        with self._on_device(), stream:
            # Allocated and zeroed on our own stream so the all-reduce is ordered after it.
            one = self._cp.zeros(1, dtype=self._cp.float32)
            try:
                comm.allReduce(one.data.ptr, one.data.ptr, 1, NCCL_FLOAT32, NCCL_SUM, stream.ptr)
            except Exception as exc:
                raise self._fail(
                    TransferError(f"NCCL warm-up all-reduce failed on {self._where()}: {exc}")
                ) from exc
        self.synchronize(
            stream, timeout=Timeouts.from_env().warmup_s if timeout is None else timeout
        )

    def broadcast(
        self, buffer: Any, *, root: int = 0, timeout: float | None = None, stream: Any = None
    ) -> None:
        """Broadcast ``buffer``'s bytes (as uint8) from ``root``; receivers are overwritten.

        ``stream=None``: runs on an internal stream and waits (bounded by ``timeout``).
        With a stream (CuPy stream, torch stream or raw pointer) it only enqueues; call
        ``synchronize(stream, timeout=...)`` before reusing the buffer."""
        self._run(buffer, root=root, timeout=timeout, stream=stream, typed=None)

    def broadcast_typed(
        self,
        buffer: Any,
        *,
        nccl_dtype: int,
        count: int,
        root: int = 0,
        timeout: float | None = None,
        stream: Any = None,
    ) -> None:
        """Unpacked mode: broadcast ``count`` elements of ``ncclDataType_t`` ``nccl_dtype``,
        the way a stock vLLM worker receives each tensor (``WIRE_DTYPES[name].nccl``)."""
        if nccl_dtype not in NCCL_ITEMSIZE:
            raise ValueError(
                f"unknown ncclDataType_t {nccl_dtype!r}; known: {sorted(NCCL_ITEMSIZE)}"
            )
        if type(count) is not int or count < 0:
            raise ValueError(f"count must be a non-negative int, got {count!r}")
        self._run(buffer, root=root, timeout=timeout, stream=stream, typed=(nccl_dtype, count))

    def _run(
        self,
        buffer: Any,
        *,
        root: int,
        timeout: float | None,
        stream: Any,
        typed: tuple[int, int] | None,
    ) -> None:
        comm = self._live()
        if type(root) is not int or not 0 <= root < self._world_size:
            raise ValueError(f"root must be a rank in [0, {self._world_size}), got {root!r}")
        cs = self._cupy_stream(stream)
        with self._on_device():
            view = resolve_buffer(buffer, self._cp, cs, sync_fallback=stream is None)
        self._check_view(view)
        dtype, count = (NCCL_UINT8, view.nbytes) if typed is None else typed
        if count * NCCL_ITEMSIZE[dtype] != view.nbytes:
            raise ValueError(
                f"broadcast_typed: {count} elements of ncclDataType_t {dtype} are "
                f"{count * NCCL_ITEMSIZE[dtype]} bytes but the buffer holds {view.nbytes}"
            )
        if count == 0:
            return  # NCCL discards empty collectives, so skipping the call is the same on the wire
        try:
            # In place (send == recv) on every rank; NCCL ignores the send pointer off-root.
            comm.broadcast(view.ptr, view.ptr, count, dtype, root, cs.ptr)
        except Exception as exc:
            raise self._fail(
                TransferError(
                    f"NCCL broadcast of {view.nbytes} bytes failed on {self._where()}: {exc}"
                )
            ) from exc
        if stream is None:
            self.synchronize(
                cs, timeout=Timeouts.from_env().transfer_s if timeout is None else timeout
            )
        else:
            # The exporter's memory must outlive the enqueued kernel even if the caller
            # drops its reference; released when this stream is next synchronized.
            self._inflight.setdefault(cs.ptr, []).append(view.owner)

    # -- point to point (sliced rounds) ---------------------------------------------------

    @contextmanager
    def group(self) -> Iterator[None]:
        """``ncclGroupStart`` / ``ncclGroupEnd`` around the sends and receives made inside:
        NCCL runs them together (one worker's chunk does not wait for another's)."""
        nccl = self._cp.cuda.nccl
        self._live()
        with self._on_device():
            nccl.groupStart()
            try:
                yield
            finally:
                try:
                    nccl.groupEnd()  # where NCCL reports a grouped call's failure
                except Exception as exc:
                    raise self._fail(
                        TransferError(f"NCCL group of calls failed on {self._where()}: {exc}")
                    ) from exc

    def send(self, buffer: Any, *, peer: int, stream: Any) -> None:
        """Enqueue ``ncclSend`` of ``buffer``'s bytes to ``peer`` on ``stream`` (never waits;
        ``synchronize(stream, timeout=...)`` before reusing the buffer)."""
        self._p2p("send", buffer, peer, stream)

    def recv(self, buffer: Any, *, peer: int, stream: Any) -> None:
        """Enqueue ``ncclRecv`` of ``buffer``'s size in bytes from ``peer`` on ``stream``;
        the bytes are there once ``synchronize(stream, timeout=...)`` returned."""
        self._p2p("recv", buffer, peer, stream)

    def _p2p(self, op: str, buffer: Any, peer: int, stream: Any) -> None:
        comm = self._live()
        if type(peer) is not int or not 0 <= peer < self._world_size or peer == self._rank:
            raise ValueError(
                f"peer must be another rank in [0, {self._world_size}), got {peer!r} "
                f"on {self._where()}"
            )
        if stream is None:
            raise ValueError(f"{op} enqueues on a stream: pass one, then synchronize it")
        cs = self._cupy_stream(stream)
        with self._on_device():
            view = resolve_buffer(buffer, self._cp, cs, sync_fallback=False)
        self._check_view(view)
        if view.nbytes == 0:
            return
        try:
            call = comm.send if op == "send" else comm.recv
            call(view.ptr, view.nbytes, NCCL_UINT8, peer, cs.ptr)
        except Exception as exc:
            raise self._fail(
                TransferError(
                    f"NCCL {op} of {view.nbytes} bytes with rank {peer} failed on "
                    f"{self._where()}: {exc}"
                )
            ) from exc
        self._inflight.setdefault(cs.ptr, []).append(view.owner)

    def keep(self, stream: Any, owners: list[Any]) -> None:
        """Keep ``owners`` (memory that work enqueued on ``stream`` reads) alive until that
        stream is next synchronized."""
        self._inflight.setdefault(self._cupy_stream(stream).ptr, []).extend(owners)

    def new_stream(self) -> Any:
        """A fresh non-blocking CuPy stream on this communicator's device."""
        with self._on_device():
            return self._cp.cuda.Stream(non_blocking=True)

    def buffer(self, nbytes: int) -> Any:
        """An uninitialised ``uint8`` CuPy array of ``nbytes`` on this device."""
        with self._on_device():
            return self._cp.empty(nbytes, dtype=self._cp.uint8)

    def upload(self, data: bytes | np.ndarray, stream: Any) -> Any:
        """``data`` copied to this device on ``stream`` (a send on it reads it after)."""
        cs = self._cupy_stream(stream)
        with self._on_device(), cs:
            return self._cp.asarray(np.frombuffer(data, dtype=np.uint8))

    def copy(self, dst_ptr: int, src: DeviceBytes, stream: Any) -> None:
        """Enqueue a device-to-device copy of ``src`` to ``dst_ptr`` on ``stream``."""
        if src.nbytes == 0:
            return
        self._check_view(src)
        cs = self._cupy_stream(stream)
        runtime = self._cp.cuda.runtime
        with self._on_device():
            runtime.memcpyAsync(dst_ptr, src.ptr, src.nbytes, runtime.memcpyDeviceToDevice, cs.ptr)

    def _check_view(self, view: DeviceBytes) -> None:
        if view.device is not None and view.device != self.device:
            raise ValueError(
                f"buffer lives on CUDA device {view.device} but this communicator "
                f"({self._where()}) is on device {self.device}"
            )

    def synchronize(self, stream: Any, *, timeout: float) -> None:
        """Wait until all work enqueued on ``stream`` so far has finished, at most ``timeout``
        seconds. On timeout or an NCCL async error: abort the communicator and raise
        (``TransferTimeout`` / ``PeerLost`` / ``TransferError``). This is the watchdog that
        turns an NCCL hang into an exception."""
        comm = self._live()
        timeout = check_seconds(timeout)
        cp = self._cp
        cs = self._cupy_stream(stream)
        with self._on_device():
            event = cp.cuda.Event(block=False, disable_timing=True)
            event.record(cs)

        def check() -> None:
            self._live()  # raises if another thread aborted us meanwhile
            self._check_async_error(comm)

        def expired() -> BaseException:
            return self._fail(
                TransferTimeout(
                    f"NCCL work did not finish within {timeout:g} s on {self._where()} "
                    f"(CUDA device {self.device}): a peer is missing, stalled or sending "
                    "a different collective; "
                    "communicator aborted"
                )
            )

        poll_until(
            lambda: event_done(event),
            deadline=time.monotonic() + timeout,
            check=check,
            check_every_s=_ASYNC_CHECK_EVERY_S,
            expired=expired,
        )
        self._inflight.pop(cs.ptr, None)

    def _check_async_error(self, comm: Any) -> None:
        try:
            comm.check_async_error()
        except Exception as exc:
            status = getattr(exc, "status", None)
            kind = PeerLost if status == _NCCL_REMOTE_ERROR else TransferError
            raise self._fail(
                kind(f"NCCL reported an asynchronous error on {self._where()}: {exc}")
            ) from exc

    def abort(self) -> None:
        """``ncclCommAbort``: tear down now without waiting on peers; later calls raise."""
        self._abort(" by abort()")

    def _abort(self, reason: str) -> None:
        with self._lock:
            if self._state != "open":
                return
            self._state, self._reason = "aborted", reason
            comm, self._comm = self._comm, None
        with suppress(Exception):  # an abort must not raise over the error that caused it
            comm.abort()
        self._inflight.clear()

    def close(self, *, timeout: float = 30.0) -> None:
        """Orderly end of a successful session (idempotent; no-op after abort).

        Waits (bounded by ``timeout``) for this rank's in-flight broadcasts, then frees the
        communicator with ``ncclCommAbort``. Not ``ncclCommDestroy``: since NCCL 2.18 it
        finalizes with the peers, and a trainer and a worker end their sessions at
        unrelated times (a server keeps its engine until shutdown), so a destroy can
        block for as long as the other side lives. With nothing in flight, abort releases
        the same resources locally and never waits on a peer.
        """
        with self._lock:
            if self._state != "open":
                return
            pending = list(self._inflight)
        for stream_ptr in pending:
            self.synchronize(
                self._cupy_stream(stream_ptr), timeout=timeout
            )  # aborts and raises if a peer stalls
        with self._lock:
            if self._state != "open":
                return
            self._state, self._reason = "closed", ""
            comm, self._comm = self._comm, None
        try:
            with self._on_device():
                comm.abort()
        except Exception as exc:
            raise TransferError(
                f"releasing the NCCL communicator failed on {self._where()}: {exc}"
            ) from exc
