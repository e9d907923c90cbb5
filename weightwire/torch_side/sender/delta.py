"""Delta rounds on a torch device: find the elements that changed.

Two implementations behind one ``DeltaKernel``, chosen by ``compaction``:

- ``cuda`` (the default on CUDA when CuPy imports: ``auto``): the fused kernel of
  ``trainer.delta_cuda``, one launch per batch of layer groups on torch's current stream, reading
  the new weights and the base once (compare, counts, compaction, the base update); the
  counts come back with one host sync per group while the next group already runs. Its
  scratch and outputs come from the session's ``Workspace`` (below), stream-ordered on it.
- ``static`` / ``nonzero`` (CPU, or no CuPy): per layer group a bitcast compare per tensor
  (one boolean mask each) and their counts, read with one host sync for the group; a
  patched tensor's indices come from ``torch.nonzero_static`` with the exact count already
  known (``nonzero``: ``torch.nonzero``, one sync per tensor), its values from one gather,
  and the patch is written into the base in place.

A tensor sent dense is copied into its base in place (the fused kernel has already written
it): the base is allocated once, at the first (dense) round.

The fused path's device memory is a ``Workspace`` per device, kept for the session: the
launches' scratch (a few buffers, each the largest launch's size, taken and given back in
turn) and the round's outputs (one ``int32`` index arena and one values arena per dtype,
carved launch after launch). Nothing of it is allocated per round once a round of the
session's largest size ran: per-round allocations of data-dependent sizes (the outputs)
split the caching allocator's blocks differently every round, and with the card near full
a miss frees the cache and retries (``num_alloc_retries``), which synchronizes the device:
an 8B round's extraction took 16.6 ms or 88.7 ms by turns on one H100 shared with the
worker (#49).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightwire.shared.errors import ConfigError
from weightwire.trainer import delta_cuda
from weightwire.trainer.delta import DeltaKernel, Extracted, Scan

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
COMPACTIONS = ("auto", "cuda", "static", "nonzero")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements, flat, as integers of the same width (a view, not a cast)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_WORDS[flat.element_size()])


ARENA_HEADROOM = 1.25
"""An output arena grows to this much more than the round that outgrew it: the next rounds'
changed fractions scatter around the last one's."""
_ARENA_GRAIN = 2 << 20


class Workspace:
    """The fused extraction's device memory on one device, kept across rounds.

    Scratch: the launches in flight each hold one buffer (``ahead + 1`` of them), every
    buffer the size of the largest launch so far (the scratch is sized by the tensors'
    patch limits, not by what changed: the same every round of a session). A buffer given
    back on one stream is taken on another only after an event (no host wait).

    Outputs: per round one index arena and one values arena per dtype; each launch's patches
    are packed at the arenas' cursors, which ``begin`` rewinds (a round's wire tensors are
    read until the next round starts). Their bound is data-dependent: an arena is the
    largest round's need so far plus ``ARENA_HEADROOM``; a round that outgrows it (the
    session's first) packs the overflowing launches into their own buffers (as before) and
    the arena grows once its launches are packed (``settle``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.scratch_bytes = 0
        self._idle: list[tuple[torch.Tensor, Any]] = []
        """Scratch buffers not in use, each with the event after its last use (or None)."""
        self._arenas: dict[str, torch.Tensor] = {}
        """``"index"`` (``int32``) or a dtype key -> the arena (typed)."""
        self._used: dict[str, int] = {}
        """Elements carved from each arena (or beside it) this round."""
        self._need: dict[str, tuple[int, torch.dtype]] = {}
        """The most elements each arena was asked for in one round so far, and its dtype."""
        self.allocations = 0
        """Device buffers allocated (scratch, arenas, overflow): none in a steady session."""

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, device=self.device)

    def begin(self) -> None:
        """A round starts: its outputs are carved from the arenas' starts."""
        self._used.clear()

    def settle(self) -> None:
        """A round's launches are all packed: grow each arena it outgrew now, so that the
        next round allocates nothing (its overflow buffers go with the round), and rewind
        them (a caller of ``start`` / ``finish`` without ``begin`` still reuses them)."""
        for key, (need, dtype) in self._need.items():
            arena = self._arenas.get(key)
            if arena is not None and arena.numel() >= need:
                continue
            grain = max(1, _ARENA_GRAIN // dtype.itemsize)
            size = -(-int(need * ARENA_HEADROOM) // grain) * grain
            # The round's slices of the old arena keep it alive as long as they are read.
            self._arenas.pop(key, None)
            self._arenas[key] = self._empty(size, dtype)
        self._used.clear()

    def scratch(self, nbytes: int, stream: int) -> tuple[int, Any]:
        """A scratch buffer of at least ``nbytes`` for a launch on ``stream`` (``Alloc``)."""
        if nbytes > self.scratch_bytes:
            self.scratch_bytes = nbytes
            self._idle.clear()  # smaller than every launch may need from now on
        if self._idle:
            buf, event = self._idle.pop()
            if event is not None:
                on = torch.cuda.ExternalStream(stream, device=self.device)
                on.wait_event(event)
                # Freed one day (outgrown, forgotten): not reused before this stream's work.
                buf.record_stream(on)
        else:
            buf = self._empty(self.scratch_bytes, torch.uint8)
        return buf.data_ptr(), buf

    def give_back(self, buf: torch.Tensor, stream: int) -> None:
        """``buf``'s launch is packed (enqueued on ``stream``): a later launch may take it."""
        if buf.numel() < self.scratch_bytes:
            return  # outgrown: back to the caching allocator
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.ExternalStream(stream, device=self.device))
        self._idle.append((buf, event))

    def outputs(self, key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``numel`` elements of this round's ``key`` arena (its own buffer past its end)."""
        if not numel:
            return torch.empty(0, dtype=dtype, device=self.device)  # no device memory
        at = self._used.get(key, 0)
        self._used[key] = at + numel
        if at + numel > self._need.get(key, (0, dtype))[0]:
            self._need[key] = (at + numel, dtype)
        arena = self._arenas.get(key)
        if arena is not None and at + numel <= arena.numel():
            return arena[at : at + numel]
        return self._empty(numel, dtype)


@dataclass
class _Fused:
    """A group on the fused kernel: launched (``pending``), later its tight outputs (one
    ``int32`` tensor of indices, one values tensor per dtype)."""

    pending: Any
    device: torch.device
    dtypes: dict[str, torch.dtype]
    index: Any = None
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    plan: Any = None


class TorchDeltaKernel(DeltaKernel):
    """``DeltaKernel`` over torch tensors (any device; the base stays on the tensor's).

    ``compaction``: ``auto`` (``cuda`` for a group wholly on one CUDA device when CuPy
    imports, else ``static``), ``cuda`` (the fused kernel; a group it cannot take falls
    back to ``static``), ``static`` or ``nonzero``; the benchmark compares them."""

    def __init__(self, compaction: str = "auto") -> None:
        if compaction not in COMPACTIONS:
            raise ConfigError(f"compaction must be one of {COMPACTIONS}, got {compaction!r}")
        self._static = compaction != "nonzero"
        self._fused = compaction in ("auto", "cuda") and delta_cuda.available()
        if compaction == "cuda" and not self._fused:
            raise ConfigError("compaction='cuda' needs CuPy and a CUDA device")
        self.workspaces: dict[torch.device, Workspace] = {}
        """The fused path's device memory, per device, for the session."""

    def begin(self) -> None:
        for workspace in self.workspaces.values():
            workspace.begin()

    def settle(self) -> None:
        for workspace in self.workspaces.values():
            workspace.settle()

    def forget(self) -> None:
        """Drop the workspaces (their memory goes back to torch's caching allocator)."""
        self.workspaces.clear()

    def _workspace(self, device: torch.device) -> Workspace:
        got = self.workspaces.get(device)
        if got is None:
            got = self.workspaces[device] = Workspace(device)
        return got

    def snapshot(self, tensor: Any) -> Any:
        return tensor.detach().clone(memory_format=torch.contiguous_format)

    def scan(self, news: Sequence[Any], bases: Sequence[Any]) -> Scan:
        masks = [_bits(n) != _bits(b) for n, b in zip(news, bases, strict=True)]
        if not masks:
            return Scan([], [])
        sums = [m.sum() for m in masks]
        one_device = len({s.device for s in sums}) == 1
        # One host sync for the group (tensors on several devices: one each).
        counts = torch.stack(sums).tolist() if one_device else [int(s) for s in sums]
        return Scan([int(c) for c in counts], masks)

    def start(self, news: Sequence[Any], bases: Sequence[Any], limits: Sequence[int]) -> Any:
        device = self._fusable(news, bases)
        if device is None:
            return self.scan(news, bases)
        flat = [n if n.is_contiguous() else n.detach().contiguous() for n in news]
        ops = [
            delta_cuda.Operand(
                n.data_ptr(), b.data_ptr(), n.numel(), n.element_size(), limit, str(n.dtype)
            )
            for n, b, limit in zip(flat, bases, limits, strict=True)
        ]
        stream = self._stream(device)
        workspace = self._workspace(device)

        def alloc(nbytes: int) -> tuple[int, Any]:
            return workspace.scratch(nbytes, stream)

        kernel = delta_cuda.fused(device.index)
        dtypes = {str(n.dtype): n.dtype for n in flat}
        return _Fused(kernel.launch(ops, stream, alloc, (flat, list(bases))), device, dtypes)

    def finish(self, started: Any) -> Scan:
        if not isinstance(started, _Fused):
            return started
        pending, device = started.pending, started.device
        kernel = delta_cuda.fused(device.index)
        counts = kernel.counts(pending)
        plan = started.plan = delta_cuda.layout(pending.operands, counts)
        # Typed tight outputs, carved from the session's arenas: a patch is one slice of each.
        workspace = self._workspace(device)
        started.index = workspace.outputs("index", torch.int32, plan.index_bytes // 4)
        for key, nbytes in plan.values_bytes.items():
            dtype = started.dtypes[key]
            started.values[key] = workspace.outputs(key, dtype, nbytes // dtype.itemsize)
        values = {k: v.data_ptr() for k, v in started.values.items()}
        scratch = pending.scratch
        kernel.pack(pending, plan, counts, started.index.data_ptr(), values)
        workspace.give_back(scratch, pending.stream)
        return Scan(counts, started, updated=True)

    def extract(self, scan: Scan, i: int, new: Any, base: Any) -> Extracted:
        if isinstance(scan.state, _Fused):
            return self._extract_fused(scan.state, scan.counts[i], i, new, base)
        mask: torch.Tensor = scan.state[i]
        if self._static:
            index = torch.nonzero_static(mask, size=scan.counts[i]).reshape(-1)
        else:
            index = torch.nonzero(mask).reshape(-1)
        values = _bits(new)[index].view(new.dtype)
        _bits(base)[index] = _bits(values)
        return Extracted(index.to(torch.int32), values, base)

    def refresh(self, new: Any, base: Any) -> Any:
        if base.shape == new.shape and base.dtype == new.dtype and base.device == new.device:
            return base.copy_(new.detach())
        return self.snapshot(new)

    def first(self, base: Any) -> Extracted:
        index = torch.zeros(1, dtype=torch.int32, device=base.device)
        return Extracted(index, base.reshape(-1)[:1].clone(), base)

    fused_type = "cuda"
    """The device type the fused kernel takes (a CPU test emulates it on ``cpu``)."""

    @staticmethod
    def _stream(device: torch.device) -> int:
        return int(torch.cuda.current_stream(device).cuda_stream)

    def _fusable(self, news: Sequence[Any], bases: Sequence[Any]) -> torch.device | None:
        """The one CUDA device of the whole group when the fused kernel can take it."""
        if not self._fused or not news:
            return None
        device = news[0].device
        if device.type != self.fused_type:
            return None
        for n, b in zip(news, bases, strict=True):
            same = n.device == device and b.device == device and n.dtype == b.dtype
            sized = n.numel() == b.numel() and n.element_size() in (1, 2, 4, 8)
            if not same or not sized or not b.is_contiguous():
                return None
        return device

    @staticmethod
    def _extract_fused(state: _Fused, count: int, i: int, new: Any, base: Any) -> Extracted:
        plan = state.plan
        at = plan.index_at[i] // 4
        values = state.values[state.pending.operands[i].key]
        vat = plan.values_at[i] // new.element_size()
        return Extracted(state.index[at : at + count], values[vat : vat + count], base)
