"""Delta rounds on a torch device: find the elements that changed.

Per layer group: a bitcast compare per tensor (one boolean mask each) and their counts,
read with one host sync for the group. A patched tensor's indices then come from
``torch.nonzero_static`` of its mask with the exact count already known (on CUDA a
single-pass stream compaction, no further sync), its values from one gather, and the
patch is written into the base in place. A tensor sent dense is copied into its base in
place: the base is allocated once, at the first (dense) round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from weightwire.trainer.delta import DeltaKernel, Extracted, Scan

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements, flat, as integers of the same width (a view, not a cast)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_WORDS[flat.element_size()])


class TorchDeltaKernel(DeltaKernel):
    """``DeltaKernel`` over torch tensors (any device; the base stays on the tensor's).

    ``compaction``: ``static`` (``nonzero_static`` with the known count, no sync) or
    ``nonzero`` (``torch.nonzero``, one sync per tensor), compared by the benchmark."""

    def __init__(self, compaction: str = "static") -> None:
        if compaction not in ("static", "nonzero"):
            raise ValueError(f"compaction must be 'static' or 'nonzero', got {compaction!r}")
        self._static = compaction == "static"

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

    def extract(self, scan: Scan, i: int, new: Any, base: Any) -> Extracted:
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
