"""CUDA IPC data plane (``weightwire_ipc``): slots, handles, events and the control channel.

What follows is push mode (the slot ring); in pull mode (``backends.ipc.pull``, the
default for packed sessions) the slots are freed right after the join, their ready
events stay, and the trainer writes straight into the worker's buffers
(``backends.ipc.pool``). The CUDA helpers here serve both.

Framework-neutral and torch-free: CUDA is reached through CuPy's runtime binding on
raw pointers, so a JAX trainer uses this module without torch. The trainer
``cudaMalloc``s its slot buffers itself (``cudaIpcGetMemHandle`` refuses JAX's own
array buffers, and exports only whole allocations, never a pool's sub-block) and
creates one interprocess "ready" event per slot; every worker opens those once per
session and creates its own "free" events, exported back in its hello.

Per piece of a chunk (at most one slot of bytes) the host sends one small JSON
message each way; the ordering itself is device-side: the worker's copy stream waits
on the slot's ready event, the trainer's fill stream on every worker's free event.
A message is sent only after the event it names was recorded, so a wait never sees a
stale record. Every host wait is bounded (``Channel.recv``, ``sync_stream``); a dead
peer shows up as ``PeerLost`` at once (its end of the channel closes).

The control channel (``ipc_channel``) is loopback TCP, authenticated both ways with
the session's 128-byte secret (HMAC challenge), carrying length-prefixed JSON.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any

from weightwire._extras import install_command
from weightwire.backends.ipc.info import IPC_HANDLE_BYTES
from weightwire.shared.errors import ConfigError, TransferError, TransferTimeout, UnavailableError
from weightwire.shared.info import encode_secret
from weightwire.shared.waiting import poll_until

CUDA_EVENT_DISABLE_TIMING, CUDA_EVENT_INTERPROCESS = 0x2, 0x4
CUDA_IPC_LAZY_PEER_ACCESS = 0x1
MEMCPY_DEVICE_TO_DEVICE = 3
CUDA_ERROR_NOT_READY = 600
MAX_MESSAGE_BYTES = 1 << 20
_POLL_S = 0.05
DEFAULT_WAIT = "device"


class IPCUnavailable(UnavailableError, RuntimeError):
    """CuPy or a CUDA device is missing, so CUDA IPC cannot be used here."""


def cupy_module() -> Any:
    try:
        import cupy  # optional dependency, GPU hosts only
    except Exception as exc:
        raise IPCUnavailable(
            "weightwire_ipc needs CuPy on a CUDA machine: "
            f"{install_command('cuda13')} (cupy-cuda13x) or "
            f"[cuda12], matching your CUDA; import failed: {exc}"
        ) from exc
    return cupy


def ipc_unavailable(backend: str) -> IPCUnavailable:
    """Why ``backend`` cannot run here (``ipc_available()`` said no): CuPy missing (its
    install command), or no CUDA device."""
    try:
        why = f"CuPy sees {int(cupy_module().cuda.runtime.getDeviceCount())} CUDA devices"
    except IPCUnavailable as exc:
        why = str(exc)
    except Exception as exc:  # the CUDA runtime itself failed (no driver)
        why = f"CuPy could not count CUDA devices ({type(exc).__name__}: {exc})"
    return IPCUnavailable(
        f"backend {backend!r} needs cupy and a CUDA device on the trainer host: {why}. On a "
        "host without a GPU use backend='weightwire_tcp' (the plugin's TCP data plane)"
    )


def ipc_available() -> bool:
    try:
        return int(cupy_module().cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def device_uuid(cp: Any, ordinal: int) -> str:
    """The GPU's UUID as lower-case hex ("" when the binding does not report it)."""
    raw = cp.cuda.runtime.getDeviceProperties(ordinal).get("uuid", b"")
    return bytes(raw).hex() if isinstance(raw, (bytes, bytearray)) else ""


# -- events -------------------------------------------------------------------------


def new_ipc_event(cp: Any) -> int:
    return int(
        cp.cuda.runtime.eventCreateWithFlags(CUDA_EVENT_DISABLE_TIMING | CUDA_EVENT_INTERPROCESS)
    )


def event_handle(cp: Any, event: int) -> bytes:
    raw = bytes(cp.cuda.runtime.ipcGetEventHandle(event))
    if len(raw) != IPC_HANDLE_BYTES:
        raise TransferError(
            f"cudaIpcGetEventHandle returned {len(raw)} bytes, expected {IPC_HANDLE_BYTES}"
        )
    return raw


def open_event(cp: Any, handle: bytes, what: str) -> int:
    try:
        return int(cp.cuda.runtime.ipcOpenEventHandle(handle))
    except Exception as exc:
        raise TransferError(
            f"cannot open {what} (cudaIpcOpenEventHandle: {exc}); "
            "is the peer on this host and alive?"
        ) from exc


def destroy_events(cp: Any, events: Iterable[int]) -> None:
    """Best effort, on teardown: a failure (its context already gone) leaves nothing to undo."""
    for event in events:
        with suppress(Exception):
            cp.cuda.runtime.eventDestroy(event)


def open_mapping(cp: Any, handle: bytes, what: str, hint: str = "") -> int:
    """A peer's allocation mapped on the current device (``cudaIpcOpenMemHandle``, lazy peer
    access); ``TransferError`` naming ``what``, then ``hint``, where it does not open."""
    try:
        return int(cp.cuda.runtime.ipcOpenMemHandle(handle, CUDA_IPC_LAZY_PEER_ACCESS))
    except Exception as exc:
        raise TransferError(f"cannot open {what} (cudaIpcOpenMemHandle: {exc}){hint}") from exc


def close_mappings(cp: Any, ptrs: Iterable[int]) -> None:
    """Best effort, on teardown, on the current device: each ``open_mapping`` closed."""
    for ptr in ptrs:
        with suppress(Exception):
            cp.cuda.runtime.ipcCloseMemHandle(ptr)


def stream_wait(cp: Any, stream_ptr: int, event: int) -> None:
    cp.cuda.runtime.streamWaitEvent(stream_ptr, event, 0)


def record(cp: Any, event: int, stream_ptr: int) -> None:
    cp.cuda.runtime.eventRecord(event, stream_ptr)


def wait_mode() -> str:
    """Where a side waits for its peer's event: ``device`` (``cudaStreamWaitEvent``: no host
    round trip, but a stream blocked on another process's event keeps its context
    scheduled) or ``host`` (poll ``cudaEventQuery``, then enqueue). ``WEIGHTWIRE_IPC_WAIT``."""
    mode = os.environ.get("WEIGHTWIRE_IPC_WAIT", DEFAULT_WAIT)
    if mode not in ("device", "host"):
        raise ConfigError(
            f"WEIGHTWIRE_IPC_WAIT must be 'device' or 'host', got {mode[:20]!r}: set one of "
            "them, or unset it for the default"
        )
    return mode


def event_query(cp: Any, event: int) -> bool:
    """True once ``event``'s last record completed (an IPC event of another process too)."""
    try:
        status = cp.cuda.runtime.eventQuery(event)
    except cp.cuda.runtime.CUDARuntimeError as exc:
        if getattr(exc, "status", None) == CUDA_ERROR_NOT_READY:
            return False
        raise
    if status in (0, None):
        return True
    if status == CUDA_ERROR_NOT_READY:
        return False
    raise TransferError(f"cudaEventQuery failed with status {status}")


def wait_event_host(
    cp: Any, event: int, *, deadline: float, what: str, alive: Callable[[], None]
) -> None:
    """Poll ``event`` until done, bounded by ``deadline`` (spin first: a piece takes ~0.1-1 ms)."""
    poll_until(
        lambda: event_query(cp, event),
        deadline=deadline,
        check=alive,
        expired=lambda: TransferTimeout(
            f"{what} did not complete within the timeout (the peer's GPU work stalled)"
        ),
    )


def sync_stream(
    cp: Any,
    device: int,
    stream_ptr: int,
    *,
    timeout: float,
    what: str,
    alive: Callable[[], None] | None = None,
) -> None:
    """Wait (bounded) until everything enqueued on ``stream_ptr`` so far finished."""
    with cp.cuda.Device(device):
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(cp.cuda.ExternalStream(stream_ptr, device))
    poll_until(
        lambda: _done(event),
        deadline=time.monotonic() + timeout,
        check=alive,
        expired=lambda: TransferTimeout(
            f"{what} did not finish on CUDA device {device} within {timeout:g} s"
        ),
    )


def _done(event: Any) -> bool:
    done = event.done
    return bool(done() if callable(done) else done)


# -- trainer-side slots -------------------------------------------------------------


class IPCSlots:
    """``count`` slot buffers of ``nbytes`` on ``device``, plus one ready event each.

    Raw ``cudaMalloc`` (not a memory pool): an IPC handle names a whole allocation.
    ``free_memory`` / ``allocate`` implement release-after-round: the events stay
    (workers keep them open), the buffers and their handles are new each time.
    """

    def __init__(self, cp: Any, device: int, nbytes: int, count: int) -> None:
        self._cp, self.device, self.nbytes, self.count = cp, int(device), int(nbytes), int(count)
        self.ptrs: list[int] = []
        self.events: list[int] = []
        with cp.cuda.Device(self.device):
            try:
                self.events = [new_ipc_event(cp) for _ in range(count)]
                self.allocate()
            except BaseException:
                self.destroy()
                raise

    def allocate(self) -> None:
        if self.ptrs:
            return
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(self.device):
            try:
                for _ in range(self.count):
                    self.ptrs.append(int(runtime.malloc(self.nbytes)))
            except Exception as exc:
                self.free_memory()
                raise TransferError(
                    f"cannot allocate {self.count} IPC slot(s) of {self.nbytes} bytes "
                    f"on CUDA device {self.device}: {exc} "
                    "(lower packed_buffer_size_bytes / packed_num_buffers, "
                    "or XLA_PYTHON_CLIENT_MEM_FRACTION)"
                ) from exc

    @property
    def allocated(self) -> bool:
        return bool(self.ptrs)

    def held_bytes(self) -> int:
        return self.nbytes * len(self.ptrs)

    def mem_handles_b64(self) -> list[str]:
        runtime = self._cp.cuda.runtime
        with self._cp.cuda.Device(self.device):
            return [encode_secret(bytes(runtime.ipcGetMemHandle(p))) for p in self.ptrs]

    def event_handles_b64(self) -> list[str]:
        with self._cp.cuda.Device(self.device):
            return [encode_secret(event_handle(self._cp, e)) for e in self.events]

    def free_memory(self) -> None:
        ptrs, self.ptrs = self.ptrs, []
        with self._cp.cuda.Device(self.device):
            for p in ptrs:
                with suppress(Exception):
                    self._cp.cuda.runtime.free(p)

    def destroy(self) -> None:
        self.free_memory()
        events, self.events = self.events, []
        destroy_events(self._cp, events)


class OpenedSlots:
    """A worker's mappings of the trainer's slots (``cudaIpcOpenMemHandle``, once per session)."""

    def __init__(self, cp: Any, device: int, handles: list[bytes]) -> None:
        self._cp, self.device = cp, int(device)
        self.ptrs: list[int] = []
        self.open(handles)

    def open(self, handles: list[bytes]) -> None:
        self.close()
        with self._cp.cuda.Device(self.device):
            for i, h in enumerate(handles):
                try:
                    self.ptrs.append(
                        open_mapping(
                            self._cp,
                            h,
                            f"the trainer's IPC slot {i}",
                            "; the trainer must run on this host, be alive, and its GPU be "
                            "reachable from this one (same GPU or peer access)",
                        )
                    )
                except TransferError:
                    self.close()
                    raise

    def close(self) -> None:
        ptrs, self.ptrs = self.ptrs, []
        with self._cp.cuda.Device(self.device):
            close_mappings(self._cp, ptrs)
