"""The worker's receive buffers for pull mode (``weightwire_ipc``).

They are exported, pooled and leased to torch.

In pull mode the trainer writes each chunk straight into a buffer of the worker's
(one device copy per byte, in the trainer's context). A buffer must therefore be
exportable: one raw ``cudaMalloc`` per buffer (``cudaIpcGetMemHandle`` names a whole
allocation, never a caching allocator's sub-block), plus one interprocess "free"
event per buffer that the trainer's fill stream waits on before writing into it.

Buffers are *leased* to torch, not owned by it: ``lease`` returns an object with a
``__cuda_array_interface__`` that ``torch.as_tensor`` wraps without copying, and torch
holds that object until its last view is gone. The lease's finalizer returns the
buffer to the pool, so torch's refcounting decides when a buffer is free again:
vLLM's layerwise reload and ``HFModelHost`` keep the tensors they are handed for a
while, and a buffer handed out again while they still read it would silently
overwrite weights (the reason every other link lands chunks in fresh allocations).
The plan repeats every round, so after round 1 the pool holds what the round needs
and no new allocation or export happens.

States: ``free`` -> ``filling`` (``acquire``: named to the trainer for a chunk) ->
``leased`` (its ready event seen, wrapped for torch; or wrapped ``ahead`` of it, then
``filled``) -> ``free`` (the lease died).
A ``filling`` buffer may be under the trainer's copy: on abort it is *leaked*, never
freed (``cudaFree`` under another process's copy is undefined behaviour); every
other buffer is freed at close (a leased one when its lease dies). ``retire_all``
(release-after-round, after the trainer closed its mappings) frees the pool the same
way; retired ids are never reused, so the trainer's per-id cache cannot go stale.

Torch-free (CUDA through CuPy's runtime), so the planning is unit-tested on CPU.
"""

from __future__ import annotations

import logging
import threading
import weakref
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from weightwire.backends.ipc.slots import event_handle, new_ipc_event, record
from weightwire.shared.errors import TransferError
from weightwire.shared.info import encode_secret

logger = logging.getLogger(__name__)

ALIGN = 2 << 20  # allocation granularity of cudaMalloc's large blocks


def size_class(nbytes: int) -> int:
    """The allocation size for a chunk of ``nbytes``: rounded up to a quarter of its
    power of two (at least ``ALIGN``), so at most ~25% is wasted and the near-equal
    chunks of a packed round (``buffer_size`` plus up to one tensor each) share a
    class and can take each other's buffers."""
    if nbytes < 1:
        raise ValueError(f"a receive buffer holds at least one byte, got {nbytes}")
    granule = max(ALIGN, (1 << (nbytes.bit_length() - 1)) // 4)
    return -(-nbytes // granule) * granule


@dataclass
class PoolBuffer:
    id: int
    ptr: int
    nbytes: int
    event: int
    state: str = "free"
    announced: bool = False
    retired: bool = False
    freed: bool = False
    ahead: bool = False  # leased ahead of its fill (``lease(ahead=True)``), not yet ``filled``
    orphaned: bool = False  # that lease died before ``filled``


class _Lease:
    """What a torch tensor over a pool buffer keeps alive (``__cuda_array_interface__``)."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


class ReceivePool:
    """Exported receive buffers of one worker session (see the module docstring)."""

    def __init__(self, cp: Any, device: int) -> None:
        self._cp, self.device = cp, int(device)
        self._buffers: dict[int, PoolBuffer] = {}
        self._next_id = 0
        self._lock = (
            threading.Lock()
        )  # the lease finalizers run on whichever thread drops the last view
        self.closed = False

    # -- the round ------------------------------------------------------------------------

    def acquire(self, nbytes: int, stream_ptr: int) -> PoolBuffer:
        """A free buffer for a chunk of ``nbytes`` (allocated and exported if none fits),
        its free event recorded on ``stream_ptr`` (the stream the buffer's previous
        readers were ordered on: torch's current stream), now ``filling``."""
        buf = self._take(nbytes, stream_ptr, allocate=True)
        assert buf is not None
        return buf

    def acquire_free(self, nbytes: int, stream_ptr: int) -> PoolBuffer | None:
        """``acquire`` without allocating: None when no free buffer fits (a buffer named
        early must not grow the pool: the round may not need it)."""
        return self._take(nbytes, stream_ptr, allocate=False)

    def _take(self, nbytes: int, stream_ptr: int, *, allocate: bool) -> PoolBuffer | None:
        want = size_class(nbytes)
        with self._lock:
            if self.closed:
                raise TransferError("the IPC receive pool is closed")
            # Best fit within one class up: a free buffer is taken rather than a new one allocated.
            fits = [
                b
                for b in self._buffers.values()
                if b.state == "free" and not b.retired and want <= b.nbytes <= want + want // 4
            ]
            buf = min(fits, key=lambda b: b.nbytes) if fits else None
            if buf is not None:
                buf.state = "filling"
        if buf is None:
            if not allocate:
                return None
            buf = self._allocate(want)
        with self._cp.cuda.Device(self.device):
            record(self._cp, buf.event, stream_ptr)
        return buf

    def describe(self, buf: PoolBuffer) -> dict[str, Any]:
        """The buffer's part of a "want" message: its id, plus its capacity and its memory
        and free-event handles the first time this session names it (the trainer opens
        them once and checks every later chunk against that capacity)."""
        out: dict[str, Any] = {"b": buf.id}
        if not buf.announced:
            out["cap"] = buf.nbytes  # the buffer may later take a larger chunk of its class
            with self._cp.cuda.Device(self.device):
                out["h"] = encode_secret(bytes(self._cp.cuda.runtime.ipcGetMemHandle(buf.ptr)))
                out["f"] = encode_secret(event_handle(self._cp, buf.event))
            buf.announced = True
        return out

    def unfill(self, buf: PoolBuffer) -> None:
        """``filling`` -> ``free`` for a buffer named early that the round did not use: the
        trainer skips it by the same rule (``ipc.pull``), so nothing writes into it."""
        with self._lock:
            if buf.state != "filling":
                raise TransferError(f"IPC receive buffer {buf.id} is {buf.state}, not filling")
            buf.state = "free"
            drop = self._claim(buf) if buf.retired or self.closed else None
        if drop is not None:
            self._free(drop)

    def lease(self, buf: PoolBuffer, nbytes: int, *, ahead: bool = False) -> _Lease:
        """Hand the filled ``buf`` to torch (``torch.as_tensor(lease)``): free again once
        the lease object and every tensor over it are gone.

        ``ahead``: the trainer may still be filling it (the worker makes the chunk's views
        before the bytes land and reads none of them before its stream waited on the
        ready event). It stays ``filling`` until ``filled``: a lease that dies before
        that (an aborted round) never frees a buffer the trainer may still be writing."""
        with self._lock:
            if buf.state != "filling":
                raise TransferError(f"IPC receive buffer {buf.id} is {buf.state}, not filling")
            if buf.ahead:
                raise TransferError(
                    f"IPC receive buffer {buf.id} is already leased ahead of its fill"
                )
            if ahead:
                buf.ahead = True
            else:
                buf.state = "leased"
        lease = _Lease(buf.ptr, nbytes)
        weakref.finalize(lease, self._returned, buf.id)
        return lease

    def filled(self, buf: PoolBuffer) -> None:
        """The ready event of a buffer leased ``ahead`` was seen: now an ordinary lease."""
        with self._lock:
            if buf.state != "filling" or not buf.ahead:
                raise TransferError(f"IPC receive buffer {buf.id} was not leased ahead of its fill")
            buf.ahead = False
            buf.state = "free" if buf.orphaned else "leased"
            buf.orphaned = False
            drop = (
                self._claim(buf) if buf.state == "free" and (buf.retired or self.closed) else None
            )
        if drop is not None:
            self._free(drop)

    def _returned(self, bid: int) -> None:
        with self._lock:
            buf = self._buffers.get(bid)
            if buf is not None and buf.state == "filling" and buf.ahead:
                buf.orphaned = True  # still (maybe) being filled: ``filled`` decides
                return
            if buf is None or buf.state != "leased":
                return
            buf.state = "free"
            drop = self._claim(buf) if buf.retired or self.closed else None
        if drop is not None:
            self._free(drop)

    # -- memory -----------------------------------------------------------------------------

    def _allocate(self, nbytes: int) -> PoolBuffer:
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(self.device):
            try:
                ptr = int(runtime.malloc(nbytes))
            except Exception as exc:
                raise TransferError(
                    f"cannot allocate an IPC receive buffer of {nbytes} bytes "
                    f"on CUDA device {self.device}: {exc} "
                    "(lower packed_buffer_size_bytes / --gpu-memory-utilization, "
                    "or use ipc_mode='push')"
                ) from exc
            try:
                event = new_ipc_event(self._cp)
            except BaseException:
                with suppress(Exception):
                    runtime.free(ptr)
                raise
        with self._lock:
            buf = PoolBuffer(self._next_id, ptr, nbytes, event, state="filling")
            self._next_id += 1
            self._buffers[buf.id] = buf
        return buf

    def _claim(self, buf: PoolBuffer) -> PoolBuffer | None:
        """Under the lock: mark ``buf`` freed if nobody did; the caller frees it unlocked."""
        if buf.freed:
            return None
        buf.freed = True
        del self._buffers[buf.id]
        return buf

    def _free(self, buf: PoolBuffer) -> None:
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(self.device):  # cudaFree waits for device work still reading it
            with suppress(Exception):
                runtime.free(buf.ptr)
            with suppress(Exception):
                runtime.eventDestroy(buf.event)

    def retire_all(self) -> None:
        """Release-after-round (the trainer closed its mappings): free every buffer now,
        a leased one when its lease dies; the next round allocates and exports anew."""
        with self._lock:
            for buf in self._buffers.values():
                buf.retired = True
            drops = [
                d
                for b in list(self._buffers.values())
                if b.state == "free" and (d := self._claim(b))
            ]
        for buf in drops:
            self._free(buf)

    def close(self) -> int:
        """End of the session: free what no copy can touch; returns the bytes leaked
        (``filling`` buffers: the trainer may still be writing them)."""
        with self._lock:
            self.closed = True
            drops = [
                d
                for b in list(self._buffers.values())
                if b.state == "free" and (d := self._claim(b))
            ]
            leaked = [b for b in self._buffers.values() if b.state == "filling"]
            for b in leaked:
                b.freed = True  # never freed: no later return may free it either
                del self._buffers[b.id]
        for buf in drops:
            self._free(buf)
        lost = sum(b.nbytes for b in leaked)
        if lost:
            logger.warning(
                "weightwire_ipc: %d receive buffer(s) (%d bytes) left allocated: "
                "the round ended while the trainer may still have been writing them",
                len(leaked),
                lost,
            )
        return lost

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)
