"""A round's staged patches applied as one scatter per destination storage.

Applying patches one tensor at a time through each tensor's own landing costs a worker a
handful of small launches and allocations per patched tensor (an 8B model has 291). Here every
patch whose tensor lands whole in one parameter's storage (``PatchTarget``: a plain, fused
q/k/v or gate/up, or tied tensor; ``LoaderMap.plain_target``) is written with one
``index_put_`` into that storage's flat view at ``index + offset`` (``int64``): one launch
per patch, no allocation beyond the offset indices.

``concat=True`` instead groups the tensors of a (device, element width) group: one ``cat`` of
their indices and of their values (bit views, so NaN payloads and signed zeros land as sent),
the storage offsets expanded per index (a scan of one step per patch), one ``index_put_`` per
storage. Fewer launches, but two more passes over the patches' bytes: on one H200, an 8B
round's patches at 2 % changed (0.94 GB) took 12.8 ms that way against 8.7 ms one patch at a
time (one dense copy of the destination parameters: 8.1 ms; ``benchmarks/bench_patch_apply.py``),
so one scatter per patch is the default on every device. That run expanded the offsets with
``repeat_interleave``, which CUDA runs one warp per patch (milliseconds for the embedding's
~10 M indices alone); the scan that replaced it is not measured on a GPU yet.

No ``.item()``, ``.cpu()`` or synchronisation per patch; the indices were checked on receipt
(``delta.check_indices``: in range and strictly increasing, one sync per round), so a storage
index never leaves its tensor's range.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Element width (bytes) -> the integer dtype whose view copies those bytes unchanged."""


@dataclass(frozen=True)
class PatchTarget:
    """Where a tensor's flat (row-major) index ``i`` lands: element ``offset + i`` of the flat
    storage named ``storage``."""

    storage: str
    offset: int


@dataclass(frozen=True)
class FusedPatch:
    """One patch to apply: its target, its flat indices and its values (both 1-D)."""

    target: PatchTarget
    index: torch.Tensor
    values: torch.Tensor
    name: str = ""
    """The checkpoint name, for messages."""


def apply_fused(
    flats: Mapping[str, torch.Tensor],
    patches: Sequence[FusedPatch],
    *,
    concat: bool = False,
) -> int:
    """Write every patch into ``flats`` (storage name -> a flat view of the whole storage);
    returns the number of scatters launched. ``concat``: one scatter per storage over the
    concatenated patches (off: one scatter per patch; see the module docstring).

    Values are cast to the storage's dtype where they differ (a parameter that casts on load),
    then copied as bits. Two patches of the same target (a tied tensor's two names, checked
    equal on receipt by ``delta.check_tied``) are applied once: the later one, as a
    one-at-a-time application would leave it."""
    last: dict[PatchTarget, FusedPatch] = {}
    for p in patches:
        last.pop(p.target, None)  # re-inserted: order follows the last occurrence
        last[p.target] = p
    groups: dict[tuple[torch.device, int], list[FusedPatch]] = {}
    for p in last.values():
        flat = flats[p.target.storage]
        if p.index.dim() != 1 or p.values.shape != p.index.shape:
            raise ValueError(
                f"patch of {p.name!r}: {list(p.values.shape)} values for indices of shape "
                f"{list(p.index.shape)} (both must be 1-D and of one length)"
            )
        groups.setdefault((flat.device, flat.element_size()), []).append(p)
    launched = 0
    for (device, width), group in groups.items():
        group.sort(key=lambda p: p.target.storage)  # stable: one slice per storage
        if concat:
            launched += _apply_group(flats, group, device, WORD[width])
        else:
            launched += _apply_each(flats, group, device, WORD[width])
    return launched


def _apply_each(
    flats: Mapping[str, torch.Tensor],
    group: list[FusedPatch],
    device: torch.device,
    word: torch.dtype,
) -> int:
    launched = 0
    words: dict[str, torch.Tensor] = {}  # each storage's integer view, made once
    for p in group:
        if not p.index.numel():
            continue
        flat = flats[p.target.storage]
        dst = words.get(p.target.storage)
        if dst is None:
            dst = words[p.target.storage] = flat.view(word)
        where = p.index.to(device=device, dtype=torch.int64)
        if p.target.offset:
            # in place on the int64 copy (the staged index itself is never written)
            owned = where is not p.index
            where = where.add_(p.target.offset) if owned else where + p.target.offset
        values = p.values
        if values.dtype == flat.dtype and values.device == device:  # as received: no cast
            bits = values.view(word)
        else:
            bits = _bits(flat, values, device, word)
        dst.index_put_((where,), bits)
        launched += 1
    return launched


def _apply_group(
    flats: Mapping[str, torch.Tensor],
    group: list[FusedPatch],
    device: torch.device,
    word: torch.dtype,
) -> int:
    counts = [p.index.numel() for p in group]
    total = sum(counts)
    if total == 0:
        return 0
    values = torch.cat([_bits(flats[p.target.storage], p.values, device, word) for p in group])
    index = torch.cat([p.index.to(device) for p in group])
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"patch indices must be int32 or int64, got {index.dtype}")
    offsets = [p.target.offset for p in group]
    if any(offsets):
        where = _offsets(offsets, counts, total, device) + index  # int64: past int32's range
    else:
        where = index.to(torch.int64)
    launched, start = 0, 0
    runs = itertools.groupby(zip(group, counts, strict=True), lambda pc: pc[0].target.storage)
    for storage, run in runs:
        n = sum(c for _, c in run)
        if n:
            flat = flats[storage].view(word)
            # index_put_, not index_copy_: the same result, and on a CPU index_copy_ is a
            # serial loop (~100x slower for a round's 2 %)
            flat.index_put_((where.narrow(0, start, n),), values.narrow(0, start, n))
            launched += 1
        start += n
    return launched


def _bits(
    flat: torch.Tensor, values: torch.Tensor, device: torch.device, word: torch.dtype
) -> torch.Tensor:
    vals = values.to(device=device, dtype=flat.dtype)
    return vals.reshape(-1).view(word)


def _offsets(
    offsets: list[int], counts: list[int], total: int, device: torch.device
) -> torch.Tensor:
    """Each patch's storage offset repeated once per index, made on the device from two small
    host lists (pinned and copied asynchronously to a GPU): the step from the previous
    patch's offset written at each patch's first index, then summed (one scan). Not
    ``repeat_interleave``: CUDA's writes each patch's run with one warp, which for a large
    patch (an 8B round's embedding: ~10 M indices) takes milliseconds alone."""
    starts: list[int] = []
    steps: list[int] = []
    at = previous = 0
    for offset, n in zip(offsets, counts, strict=True):
        if n:  # an empty patch has no first index (and would share the next one's)
            starts.append(at)
            steps.append(offset - previous)
            previous = offset
        at += n
    host = torch.tensor([starts, steps], dtype=torch.int64)
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    marks = torch.zeros(total, dtype=torch.int64, device=device)
    marks.index_put_((dev[0],), dev[1])  # distinct positions: one step each
    return marks.cumsum(0)
