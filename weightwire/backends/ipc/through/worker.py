"""The worker's end of ``weightwire_ipc`` write-through: ``IPCWriteThroughLink``.

Once per round metadata (and again if a parameter moved) the worker records where its
model's loader puts every tensor (the core's ``record``: ``landing.record_loader_map``),
exports each parameter allocation's ``cudaIpcMemHandle_t`` and sends the landing table
(``table``), then waits for the trainer's ``path``. When the trainer takes it, every
later round with these tensors costs one message each way: ``go`` (sent once the core
recorded the round as written in place, after this worker's free event was recorded on
torch's current stream: the model's last reads of its parameters come first) and
``done`` (the stream then waits on the trainer's ready event). Otherwise (a loader that
is not a plain copy, memory that cannot be shared, the trainer declining) the round goes
through the receive pool as in pull mode, and the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightwire._trace import dump_trace, trace
from weightwire.backends.ipc import worker as ipc_worker
from weightwire.backends.ipc.channel import check_int
from weightwire.backends.ipc.info import IPCInitInfo
from weightwire.backends.ipc.push.worker import IPCLink
from weightwire.backends.ipc.receiver import IPCReceiver
from weightwire.backends.ipc.slots import record, stream_wait, wait_event_host
from weightwire.backends.ipc.through.table import (
    Alloc,
    Land,
    LandingTable,
    ParamSlot,
    TensorLands,
    can_cast,
    refusal_message,
    table_messages,
)
from weightwire.backends.ipc.worker import IPCPullLink
from weightwire.backends.worker_base import LandingRecord, ReceiveProgress, ReceiveTurn, WorkerPairs
from weightwire.shared.dtypes import WIRE_DTYPES
from weightwire.shared.errors import TransferError
from weightwire.shared.meta import ParamMeta

log = logging.getLogger(__name__)


def connect_ipc(
    info: IPCInitInfo,
    *,
    rank: int,
    device: torch.device,
    landing: Callable[[], LandingRecord] | None = None,
) -> IPCLink | IPCPullLink:
    """``weightwire_ipc``'s connect (the registry's): ``ipc.worker.connect_ipc``, offering
    write-through to the trainer beside pull and push (``landing``: whether the model can
    take it, said in the hello)."""
    return ipc_worker.connect_ipc(
        info, rank=rank, device=device, through=IPCWriteThroughLink, landing=landing
    )


@dataclass(frozen=True)
class _Offered:
    """The table this session offered for one round metadata, and the trainer's answer."""

    tid: int
    metas: Sequence[ParamMeta]
    through: bool
    params: tuple[Any, ...] = ()
    """The parameters it names (their pointers are checked every round)."""
    ptrs: tuple[int, ...] = ()

    def holds(self, metas: Sequence[ParamMeta]) -> bool:
        if not (self.metas is metas or list(self.metas) == list(metas)):
            return False
        return self.live()

    def live(self) -> bool:
        """Every parameter it names is still where it was exported (checked at every round's
        start, before the go: one C-level pass, no generator per parameter)."""
        return tuple(map(torch.Tensor.data_ptr, self.params)) == self.ptrs

    @functools.cached_property
    def names(self) -> frozenset[str]:
        """The tensors it lands (built once: a round's start asks for them)."""
        return frozenset(m.name for m in self.metas)


class IPCWriteThroughLink(IPCPullLink):
    """Pull mode plus write-through (see the module docstring)."""

    def __init__(
        self, communicator: IPCReceiver, *, device: torch.device, timeout_s: float, depth: int
    ) -> None:
        super().__init__(communicator, device=device, timeout_s=timeout_s, depth=depth)
        self._offered: _Offered | None = None
        self._next_tid = 0
        self._through = False
        self._went = False  # this round's go was sent at its start
        self._told: set[str] = set()

    def start_round(self) -> None:
        trace("wt start")
        self._went = False
        super().start_round()

    def early_landing(self) -> frozenset[str] | None:
        offered = self._offered
        if offered is None or not offered.through or not offered.live():
            return None
        return offered.names

    def go_early(self) -> None:
        """The trainer may write this session's table from now on: it checks that the table
        is for its round's tensors (else it waits for this worker's next message)."""
        assert self._offered is not None
        self._go({"op": "go", "t": self._offered.tid, "early": True})
        self._went = True

    def _go(self, msg: dict[str, Any]) -> None:
        rx = self.communicator
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with rx.cp.cuda.Device(rx.device):
            record(rx.cp, rx.free[0], stream)  # the model's reads so far come before any write
        rx.channel.send(msg)
        trace("wt go")

    def lands(self, turn: ReceiveTurn, record: Callable[[], LandingRecord]) -> bool:
        self.communicator.alive()
        trace("wt lands")
        self._through = False
        if not any(c.nbytes for c in turn.chunks):  # no byte: the trainer asks nothing either
            return False
        offered = self._offered
        if offered is None or not offered.holds(turn.metas):
            self._went = False  # the trainer ignores a go for another table's tensors
            offered = self._offered = self._offer(turn.metas, record)
        self._through = offered.through
        return offered.through

    def _offer(self, metas: Sequence[ParamMeta], record: Callable[[], LandingRecord]) -> _Offered:
        rx = self.communicator
        ch = rx.channel
        tid, self._next_tid = self._next_tid, self._next_tid + 1
        got = record()
        try:
            if got.map is None:
                raise TransferError(got.refused or "no landing map")
            table, params = export_table(got.map, metas, rx.cp, rx.device)
        except TransferError as exc:
            self._tell(f"the model's loader cannot be written through ({exc})")
            ch.send(refusal_message(tid, str(exc)))
            return _Offered(tid, metas, False)
        for msg in table_messages(table, tid):
            ch.send(msg)
        answer = ch.expect(
            "path",
            deadline=time.monotonic() + self.timeout_s,
            what="the trainer's answer to the landing table",
            alive=rx.alive,
        )
        if answer.get("t") != tid:
            raise TransferError(f"{ch.peer} answered table {answer.get('t')!r}, not {tid}")
        if answer.get("wt") is not True:
            self._tell(f"the trainer does not write through: {str(answer.get('why'))[:500]}")
            return _Offered(tid, metas, False)
        log.info("weightwire_ipc: the trainer writes rounds straight into the parameters")
        return _Offered(tid, metas, True, params, tuple(p.data_ptr() for p in params))

    def _tell(self, why: str) -> None:
        if why not in self._told:
            self._told.add(why)
            log.warning("weightwire_ipc: %s; rounds land in the receive buffers (pull)", why)

    def receive(self, turn: ReceiveTurn, progress: ReceiveProgress) -> Iterator[WorkerPairs]:
        if not self._through:
            yield from super().receive(turn, progress)
            return
        self._through = False
        rx = self.communicator
        cp, ch = rx.cp, rx.channel
        assert self._offered is not None
        progress.chunk = 0
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if not self._went:
            self._go({"op": "go", "t": self._offered.tid})
        self._went = False
        deadline = time.monotonic() + self.timeout_s
        msg = ch.expect("done", deadline=deadline, what="the trainer's writes", alive=rx.alive)
        event = rx.ready[check_int(msg, "e", 0, len(rx.ready) - 1, ch.peer)]
        with cp.cuda.Device(rx.device):
            if self._host_wait:
                wait_event_host(
                    cp, event, deadline=deadline, what="the trainer's writes", alive=rx.alive
                )
            else:
                stream_wait(cp, stream, event)
        progress.chunk = len(turn.chunks) - 1
        progress.nbytes += sum(c.nbytes for c in turn.chunks)  # written by the trainer
        trace("wt done")
        dump_trace("worker")


def export_table(
    landing: Any, metas: Sequence[ParamMeta], cp: Any, device: int
) -> tuple[LandingTable, tuple[Any, ...]]:
    """``landing`` (a ``LoaderMap``) as a table for ``metas``, each parameter allocation's
    IPC handle exported; ``TransferError`` saying why it cannot be written through."""
    names = list(landing.params)
    index = {n: i for i, n in enumerate(names)}
    params = tuple(landing.params[n] for n in names)
    allocs: list[Alloc] = []
    bases: dict[int, int] = {}
    slots = []
    with cp.cuda.Device(device):
        for name, p in zip(names, params, strict=True):
            dtype = str(p.dtype).removeprefix("torch.")
            if dtype not in WIRE_DTYPES or p.device.type != "cuda":
                raise TransferError(f"parameter {name!r} is {p.dtype} on {p.device}")
            storage = p.untyped_storage()
            ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
            base, size = allocation_of(ptr, name, device)
            if base not in bases:
                try:
                    handle = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
                except Exception as exc:
                    raise TransferError(
                        f"parameter {name!r}'s memory cannot be shared (cudaIpcGetMemHandle: "
                        f"{exc}; memory from cuMemCreate, as with expandable segments, cannot)"
                    ) from None
                bases[base] = len(allocs)
                allocs.append(Alloc(handle, size))
            slots.append(ParamSlot(name, bases[base], ptr - base, nbytes, dtype))
    tensors = []
    for meta in metas:
        entry = landing.tensors.get(meta.name)
        if entry is None:
            raise TransferError(f"the landing map has no entry for {meta.name!r}")
        lands = []
        for x in entry.landings:
            if x.param not in index:
                raise TransferError(f"{meta.name!r} lands in {x.param!r}, not a recorded parameter")
            if not can_cast(meta.dtype, slots[index[x.param]].dtype):
                raise TransferError(
                    f"{meta.name!r} ({meta.dtype}) lands in {x.param!r} "
                    f"({slots[index[x.param]].dtype}): a cast write-through does not do"
                )
            lands.append(
                Land(
                    index[x.param],
                    tuple(x.shape),
                    int(x.src_offset),
                    tuple(x.src_strides),
                    int(x.dst_offset),
                    tuple(x.dst_strides),
                )
            )
        tensors.append(TensorLands(meta.name, tuple(lands)))
    return LandingTable(tuple(allocs), tuple(slots), tuple(tensors)), params


_CUDA: Any = None


def _driver() -> Any:
    global _CUDA
    if _CUDA is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        _CUDA = lib
    return _CUDA


def _ensure_context(lib: Any, device: int) -> None:
    """Make the device's primary context current on this thread (the driver API needs one;
    the runtime binds it lazily, and this thread may not have made a runtime call yet)."""
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and ctx.value:
        return
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device)) != 0:
        return
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0:
        lib.cuCtxSetCurrent(ctx)


def allocation_of(ptr: int, what: str, device: int) -> tuple[int, int]:
    """The device allocation holding ``ptr``: its base and size (``cuMemGetAddressRange``;
    an IPC handle names a whole allocation, and a caching allocator's block is a slice)."""
    try:
        lib = _driver()
        _ensure_context(lib, device)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    except OSError as exc:
        raise TransferError(f"cannot find the allocation of {what!r}: {exc}") from None
    if rc != 0:
        raise TransferError(f"cannot find the allocation of {what!r} (cuMemGetAddressRange: {rc})")
    return int(base.value), int(size.value)
