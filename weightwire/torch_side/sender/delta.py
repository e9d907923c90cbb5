"""Delta rounds on a torch device: find the elements that changed.

Two implementations behind one ``DeltaKernel``, chosen by ``compaction``:

- ``cuda`` (the default on CUDA when CuPy imports: ``auto``): the fused kernel of
  ``trainer.delta_cuda``, one launch per batch of layer groups on torch's current stream, reading
  the new weights and the base once (compare, counts, compaction, the base update); the
  counts come back with one host sync per group while the next group already runs. Its
  scratch and outputs come from torch's caching allocator on that stream.
- ``static`` / ``nonzero`` (CPU, or no CuPy): per layer group a bitcast compare per tensor
  (one boolean mask each) and their counts, read with one host sync for the group; a
  patched tensor's indices come from ``torch.nonzero_static`` with the exact count already
  known (``nonzero``: ``torch.nonzero``, one sync per tensor), its values from one gather,
  and the patch is written into the base in place.

A tensor sent dense is copied into its base in place (the fused kernel has already written
it): the base is allocated once, at the first (dense) round.
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

        def alloc(nbytes: int) -> tuple[int, Any]:
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return t.data_ptr(), t

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
        # Typed tight buffers: a patch is one slice of each.
        started.index = torch.empty(plan.index_bytes // 4, dtype=torch.int32, device=device)
        for key, nbytes in plan.values_bytes.items():
            dtype = started.dtypes[key]
            size = nbytes // dtype.itemsize
            started.values[key] = torch.empty(size, dtype=dtype, device=device)
        values = {k: v.data_ptr() for k, v in started.values.items()}
        kernel.pack(pending, plan, counts, started.index.data_ptr(), values)
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
