"""What an overlapped torch round sends: the parameters copied into reusable buffers.

A torch optimizer writes its parameters in place, so a round that streams while the next
step trains must read a copy. ``CopySnapshots`` keeps one set of buffers per round in
flight (``max_rounds_in_flight``), allocated at the first round and reused after while
every tensor keeps its shape, dtype and device: a round costs one device-to-device copy
per tensor on the trainer's thread, on its current stream, and no allocation.
``snapshot="none"`` skips the copy on the caller's promise not to write the parameters
until the round's handle is done.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from weightwire.shared.errors import ConfigError, WrongType
from weightwire.shared.source import WeightSource
from weightwire.trainer.snapshot import FrozenSource, Snapshot

Buffers = dict[str, torch.Tensor]


class CopySnapshots:
    """A pool of buffer sets; ``take`` fills one, the round's end gives it back."""

    def __init__(self) -> None:
        self._free: list[Buffers] = []
        self._in_use: dict[int, Buffers] = {}
        self._lock = threading.Lock()  # the round thread gives back, the trainer's thread takes

    @property
    def nbytes(self) -> int:
        """Device memory the buffer sets hold (in use by a round or free for the next)."""
        with self._lock:
            sets = [*self._free, *self._in_use.values()]
        return sum(t.nbytes for b in sets for t in b.values())

    def take(self, source: WeightSource) -> Snapshot:
        """Copy ``source``'s tensors now (the trainer's thread); the round waits for the copy
        to finish on the device before reading (``Snapshot.ready``)."""
        with self._lock:
            buffers = self._free.pop() if self._free else {}
        metas = source.metadata()
        pairs: list[tuple[str, Any]] = []
        kept: Buffers = {}
        try:
            for name, tensor in source:
                kept[name] = copy_into(buffers.get(name), tensor)
                pairs.append((name, kept[name]))
        except BaseException:
            self._give_back(kept)
            raise
        # Only this pass's names are kept: a renamed or dropped tensor frees its buffer.
        with self._lock:
            self._in_use[id(kept)] = kept
        ready = device_wait(kept.values())
        return Snapshot(
            FrozenSource(metas, pairs), ready=ready, release=lambda: self._give_back(kept)
        )

    def _give_back(self, buffers: Buffers) -> None:
        with self._lock:
            self._in_use.pop(id(buffers), None)
            self._free.append(buffers)


def copy_into(buffer: torch.Tensor | None, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in ``buffer`` when it fits (same shape, dtype, device), else in a
    new contiguous tensor that becomes the buffer."""
    if not isinstance(tensor, torch.Tensor):
        raise WrongType(f"source yielded {type(tensor).__name__}, expected torch.Tensor")
    source = tensor.detach()
    if (
        buffer is None
        or buffer.shape != source.shape
        or buffer.dtype != source.dtype
        or buffer.device != source.device
    ):
        buffer = torch.empty(source.shape, dtype=source.dtype, device=source.device)
    buffer.copy_(source, non_blocking=source.is_cuda)
    return buffer


def device_wait(tensors: Any) -> Any:
    """A callable that blocks until the copies just queued on each CUDA device are done
    (recorded on the trainer's current streams; the round runs on another thread)."""
    events = []
    for device in {t.device for t in tensors if t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)

    def ready() -> None:
        for event in events:
            event.synchronize()

    return ready


def live(source: WeightSource) -> Snapshot:
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
    events = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        events.append(event)

    def ready() -> None:
        for event in events:
            event.synchronize()

    return Snapshot(source, ready=ready)
