"""What an overlapped torch round sends: the parameters copied into reusable buffers.

A torch optimizer writes its parameters in place, so a round that streams while the next
step trains must read a copy. ``CopySnapshots`` keeps one set of buffers per round in
flight (``max_rounds_in_flight``), allocated at the first round and reused after while
every tensor keeps its shape, dtype and device: a round costs a device-to-device copy of
every tensor, queued on the trainer's current stream from its thread (one foreach call per
group of tensors, no host wait), and no allocation.
``snapshot="none"`` skips the copy on the caller's promise not to write the parameters
until the round's handle is done.

Every mode's round runs on its own CUDA stream per device (``RoundStreams``): the round
thread's device work (the packer's streams wait on the round thread's current stream) is
then ordered after the snapshot (``ready``, the copies' events) and never after the trainer's
next step, which it queues meanwhile on its own stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from weightwire.shared.errors import ConfigError, TransferTimeout, WrongType
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.shared.waiting import poll_until
from weightwire.trainer.snapshot import FrozenSource, Snapshot

logger = logging.getLogger(__name__)

Buffers = dict[str, torch.Tensor]


class RoundStreams:
    """One engine's overlapped rounds' CUDA streams: one per device, made at the first round
    on it and current on the round thread while a round reads its snapshot (one round runs at
    a time, on the runner's one thread).

    Why: a thread's current stream starts as the device's default stream, the one a trainer
    usually queues its steps on, and the round's device work waits on the round thread's
    current stream (``TorchDevicePacker.regions``). On the default stream a round queued
    behind the whole next training step (on one H100, a 20 ms round ended after the 400 ms
    step). On its own stream it waits only for what the snapshot says: ``ready`` (the
    trainer's work up to ``send_weights``, waited on the host) and a copy's event (``cow``).
    """

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._streams: dict[int, torch.cuda.Stream] = {}

    def context(self, devices: Sequence[int]) -> Callable[[], AbstractContextManager[Any]]:
        """What ``Snapshot.context`` enters on the round thread for tensors on ``devices``
        (CUDA indices; none: nothing to do)."""
        if not devices:
            return nullcontext
        return lambda: self._current(devices)

    @contextmanager
    def _current(self, devices: Sequence[int]) -> Iterator[None]:
        here = torch.cuda.current_device()
        before = [torch.cuda.current_stream(d) for d in devices]
        ours = [self._stream(d) for d in devices]
        try:
            for stream in ours:
                torch.cuda.set_stream(stream)  # it also makes the stream's device current
            torch.cuda.set_device(here)
            yield
        finally:
            try:
                # The round's work on our streams may read the snapshot (a copy allocated on
                # the trainer's stream): done before ``release`` lets the allocator reuse it.
                # Never the round's error: a round that ran to its end has committed (a
                # failure reported now would be one that took effect), a failed one keeps
                # its own; a stream that will not drain is logged.
                for stream in ours:
                    settle(stream, self._wait_s, raising=False)
            finally:
                for stream in before:
                    torch.cuda.set_stream(stream)
                torch.cuda.set_device(here)

    def _stream(self, device: int) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream


def settle(stream: torch.cuda.Stream, bound: float, *, raising: bool = True) -> None:
    """Until ``stream`` ran the work queued on it, at most ``bound`` seconds
    (``TransferTimeout``; ``raising=False``: logged, for a round that failed already and
    keeps its own error)."""

    def expired() -> BaseException:
        return TransferTimeout(
            f"the overlapped round's CUDA stream on device {stream.device_index} still had "
            f"work queued after {bound:g} s (a hung kernel?); check the GPU (nvidia-smi) "
            "before the next round"
        )

    try:
        poll_until(stream.query, deadline=time.monotonic() + bound, expired=expired)
    except TransferTimeout as exc:
        if raising:
            raise
        logger.error("%s", exc)


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The CUDA device indices of ``tensors`` (``get_device``: -1 on the CPU; an int per
    tensor, no ``torch.device`` object: a snapshot asks this of every tensor)."""
    return sorted({t.get_device() for t in tensors} - {-1})


class CopySnapshots:
    """A pool of buffer sets; ``take`` fills one, the round's end gives it back."""

    def __init__(self, streams: RoundStreams) -> None:
        self._streams = streams
        self._free: list[Buffers] = []
        self._in_use: dict[int, Buffers] = {}
        self._lock = threading.Lock()  # the round thread gives back, the trainer's thread takes

    @property
    def nbytes(self) -> int:
        """Device memory the buffer sets hold (in use by a round or free for the next)."""
        with self._lock:
            sets = [*self._free, *self._in_use.values()]
        return sum(t.nbytes for b in sets for t in b.values())

    def take(self, source: WeightSource, metas: list[ParamMeta] | None = None) -> Snapshot:
        """Copy ``source``'s tensors now (the trainer's thread); the round waits for the copy
        to finish on the device before reading (``Snapshot.ready``)."""
        with self._lock:
            buffers = self._free.pop() if self._free else {}
        metas = source.metadata() if metas is None else metas
        pairs: list[tuple[str, Any]] = []
        kept: Buffers = {}
        # One foreach copy per group instead of one copy_ per tensor (on a GPU ~10 us of the
        # trainer's thread each: 3-4 ms for a 291-tensor model). A group is bounded so that
        # a source yielding new tensors (a cast) is not held whole meanwhile.
        dests: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        held = 0
        try:
            for name, tensor in source:
                src = _detached(tensor, name)
                buffer = kept[name] = fitting(buffers.get(name), src)
                pairs.append((name, buffer))
                dests.append(buffer)
                srcs.append(src)
                held += src.nbytes
                if held >= GROUP_BYTES:
                    copy_all(dests, srcs)
                    dests, srcs, held = [], [], 0
            copy_all(dests, srcs)
        except BaseException:
            self._give_back(kept)
            raise
        # Only this pass's names are kept: a renamed or dropped tensor frees its buffer.
        with self._lock:
            self._in_use[id(kept)] = kept
        devices = cuda_devices(kept.values())
        return Snapshot(
            FrozenSource(metas, pairs),
            ready=device_wait(devices),
            release=lambda: self._give_back(kept),
            context=self._streams.context(devices),
        )

    def _give_back(self, buffers: Buffers) -> None:
        with self._lock:
            self._in_use.pop(id(buffers), None)
            self._free.append(buffers)


GROUP_BYTES = 1 << 30
"""The most source bytes one foreach copy of ``CopySnapshots.take`` takes."""


def _detached(tensor: Any, name: str) -> torch.Tensor:
    tensor = source_tensor(tensor, name)
    return tensor.detach() if tensor.requires_grad else tensor


def source_tensor(tensor: Any, name: str | None = None) -> torch.Tensor:
    """``tensor`` when a round can read its values: a ``torch.Tensor`` (``WrongType``
    otherwise) that holds data (``ConfigError`` for one on the ``meta`` device, which only
    torch's own copy would otherwise refuse, as a bare ``NotImplementedError``)."""
    which = f" for {name!r}" if name is not None else ""
    if not isinstance(tensor, torch.Tensor):
        raise WrongType(f"source yielded {type(tensor).__name__}, expected torch.Tensor{which}")
    if tensor.is_meta:
        raise ConfigError(
            f"source yielded{which} a tensor on torch's meta device, which holds no values to "
            "send (a model built under init_empty_weights / device='meta', or a parameter not "
            "yet materialized); load or materialize its weights (to_empty() then load them) "
            "before sending"
        )
    return tensor


def fitting(buffer: torch.Tensor | None, source: torch.Tensor) -> torch.Tensor:
    """``buffer`` when it can take ``source``'s values (same shape, dtype, device), else a new
    contiguous tensor that becomes the buffer."""
    if (
        buffer is None
        or buffer.shape != source.shape
        or buffer.dtype != source.dtype
        or buffer.is_cuda != source.is_cuda
        or buffer.get_device() != source.get_device()  # an int: no torch.device per tensor
    ):
        buffer = torch.empty(source.shape, dtype=source.dtype, device=source.device)
    return buffer


def copy_all(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dests[i] <- srcs[i]``, queued on the current streams (no host wait on a GPU)."""
    if dests:
        torch._foreach_copy_(dests, srcs, non_blocking=True)


def device_wait(devices: Sequence[int]) -> Callable[[], None]:
    """A callable that blocks until the work queued so far on each CUDA device's current
    stream (the trainer's: the last step, a snapshot's copies) is done; the round runs it on
    its own thread."""
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)

    def ready() -> None:
        for event in events:
            event.synchronize()

    return ready


def live(source: WeightSource, streams: RoundStreams) -> Snapshot:
    """``snapshot="none"``: the source itself, read while the round runs (the caller keeps
    the parameters unchanged until the handle is done). The round still waits for the work
    queued so far on the trainer's current CUDA stream, so it reads the last step's values."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(
            'snapshot="none" reads the source on the round thread, where its gathers (FSDP '
            "full_tensor) would interleave with the training step's collectives; use the "
            'default snapshot="copy" with several trainer processes'
        )
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = [torch.cuda.current_device()] if cuda else []
    return Snapshot(source, ready=device_wait(devices), context=streams.context(devices))
