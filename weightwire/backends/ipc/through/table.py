"""The landing table of ``weightwire_ipc`` write-through: where each tensor lands, as messages.

The worker records, once per round metadata, where its model's own loader puts every
checkpoint tensor (``torch_side.worker.landing``), and tells the trainer in a ``land``
message (plus ``land_part`` messages when it is large):

- ``allocs``: one ``[handle, bytes]`` per device allocation holding parameters
  (``cudaIpcMemHandle_t`` of the allocation's base, standard base64);
- ``params``: ``[name, alloc, offset, bytes, dtype]`` per parameter: where its storage
  starts in that allocation, its size and its dtype;
- ``tensors``: per tensor of the round, in wire order, ``[name, [landing, ...]]`` with a
  landing ``[param, shape, src_offset, src_strides, dst_offset, dst_strides]`` (elements;
  the source a C-contiguous tensor of the round, the destination ``as_strided`` on the
  parameter's storage). No landing: nothing of the tensor lives on that worker.

``read_table`` checks every field before the trainer maps anything: the tensors are the
round's, in its order; every view lies inside its tensor and inside its parameter's
storage, which lies inside its allocation; the dtypes are wire dtypes and a cast is one
``kernels`` does; no view reads or writes an element twice (no stride 0, no overlapping
dims) and no two landings write the same parameter element, so the copies a table plans
never write more bytes than its parameters hold (the worker's own map keeps the same
rules: ``torch_side.worker.landing_rules``). ``plan_copies`` turns a checked table into
copies: contiguous runs (byte rows for the gather kernel) where source and destination run
together, a strided (or casting) copy per landing otherwise. Torch-free and CUDA-free: CPU-tested.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightwire.backends.ipc.info import IPC_HANDLE_BYTES
from weightwire.shared.dtypes import WIRE_DTYPES
from weightwire.shared.errors import TransferError
from weightwire.shared.info import decode_secret, encode_secret
from weightwire.shared.meta import ParamMeta

FLOATS = ("bfloat16", "float16", "float32", "float64")
"""Dtypes a write-through copy may cast between (as torch's ``copy_`` rounds)."""
MAX_NDIM = 8
MAX_LANDINGS = 1 << 12
"""Landings of one tensor (a fused expert tensor: one per expert)."""
MAX_PARTS = 1 << 12
PART_LANDINGS = 1 << 11
"""Landings per message (a message stays far below the channel's 1 MiB)."""
MAX_RUNS = 1 << 16
"""A landing cut into more contiguous runs than this is copied by the strided kernel."""
MIN_RUN_BYTES = 512
"""Runs shorter than this are copied by the strided kernel (a row per few bytes is slower)."""
MAX_CHECK_RUNS = 1 << 20
"""Destination runs the overlap check may list for one parameter's interleaved landings
(column slices); a table cut finer is refused."""


def can_cast(src: str, dst: str) -> bool:
    """Whether a write-through copy lands a ``src`` tensor in a ``dst`` parameter."""
    return src == dst or (src in FLOATS and dst in FLOATS)


@dataclass(frozen=True)
class Alloc:
    handle: bytes
    nbytes: int


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's storage: ``nbytes`` at ``offset`` into allocation ``alloc``."""

    name: str
    alloc: int
    offset: int
    nbytes: int
    dtype: str


@dataclass(frozen=True)
class Land:
    """One view of a tensor copied into one view of a parameter (elements)."""

    param: int
    shape: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]


@dataclass(frozen=True)
class TensorLands:
    name: str
    lands: tuple[Land, ...]


@dataclass(frozen=True)
class LandingTable:
    allocs: tuple[Alloc, ...]
    params: tuple[ParamSlot, ...]
    tensors: tuple[TensorLands, ...]
    """In the round's wire order, one per tensor."""


# -- messages ---------------------------------------------------------------------------------


def table_messages(table: LandingTable, tid: int) -> list[dict[str, Any]]:
    """The ``land`` message and its ``land_part`` followers for ``table`` (id ``tid``)."""
    parts: list[list[Any]] = [[]]
    count = 0
    for t in table.tensors:
        if count and count + len(t.lands) > PART_LANDINGS:
            parts.append([])
            count = 0
        parts[-1].append([t.name, [_land_row(x) for x in t.lands]])
        count += max(1, len(t.lands))
    head: dict[str, Any] = {
        "op": "land",
        "t": tid,
        "parts": len(parts),
        "allocs": [[encode_secret(a.handle), a.nbytes] for a in table.allocs],
        "params": [[p.name, p.alloc, p.offset, p.nbytes, p.dtype] for p in table.params],
        "tensors": parts[0],
    }
    return [head] + [{"op": "land_part", "t": tid, "tensors": p} for p in parts[1:]]


def refusal_message(tid: int, reason: str) -> dict[str, Any]:
    """The ``land`` message of a worker that cannot be written through (its loader refused)."""
    return {"op": "land", "t": tid, "refused": reason[:2000]}


def _land_row(x: Land) -> list[Any]:
    return [
        x.param,
        list(x.shape),
        x.src_offset,
        list(x.src_strides),
        x.dst_offset,
        list(x.dst_strides),
    ]


def read_table(
    head: dict[str, Any],
    more: Callable[[], dict[str, Any]],
    metas: Sequence[ParamMeta],
    peer: str,
) -> LandingTable:
    """The table a ``land`` message (``head``) and its parts (``more()``, each the next
    ``land_part``) describe, every field checked against the round's ``metas``."""
    bad = _Bad(peer)
    tid = head.get("t")
    nparts = _int(head, "parts", 1, MAX_PARTS, bad)
    allocs = tuple(_alloc(a, i, bad) for i, a in enumerate(_list(head, "allocs", 1 << 16, bad)))
    params = tuple(
        _param(p, i, allocs, bad) for i, p in enumerate(_list(head, "params", 1 << 20, bad))
    )
    if len({p.name for p in params}) != len(params):
        raise bad("names a parameter twice")
    rows = list(_list(head, "tensors", len(metas), bad))
    for k in range(1, nparts):
        part = more()
        if part.get("op") != "land_part" or part.get("t") != tid:
            raise bad(f"sent {str(part.get('op'))[:20]!r} where part {k} of table {tid} was due")
        rows.extend(_list(part, "tensors", len(metas), bad))
    if len(rows) != len(metas):
        raise bad(f"lists {len(rows)} tensors for a round of {len(metas)}")
    tensors = tuple(_tensor(r, m, params, bad) for r, m in zip(rows, metas, strict=True))
    _check_disjoint(params, tensors, bad)
    return LandingTable(allocs, params, tensors)


class _Bad:
    def __init__(self, peer: str) -> None:
        self.peer = peer

    def __call__(self, what: str) -> TransferError:
        return TransferError(f"{self.peer}'s landing table {what}")


def _int(msg: Any, key: Any, lo: int, hi: int, bad: _Bad) -> int:
    value = msg[key] if isinstance(msg, (dict, list)) else None
    if type(value) is not int or not lo <= value <= hi:
        raise bad(f"has {key}={json.dumps(value)[:40]}, outside [{lo}, {hi}]")
    return value


def _list(msg: dict[str, Any], key: str, most: int, bad: _Bad) -> list[Any]:
    value = msg.get(key)
    if not isinstance(value, list) or len(value) > most:
        raise bad(f"has no list {key!r} of at most {most} entries")
    return value


def _row(value: Any, n: int, what: str, bad: _Bad) -> list[Any]:
    if not isinstance(value, list) or len(value) != n:
        raise bad(f"has a malformed {what}: {json.dumps(value)[:80]}")
    return value


def _alloc(value: Any, i: int, bad: _Bad) -> Alloc:
    row = _row(value, 2, f"allocation {i}", bad)
    try:
        handle = decode_secret(
            f"{bad.peer}'s landing table allocation {i}", row[0], IPC_HANDLE_BYTES
        )
    except ValueError as exc:
        raise TransferError(str(exc)) from None
    return Alloc(handle, _int(row, 1, 1, 1 << 50, bad))


def _param(value: Any, i: int, allocs: tuple[Alloc, ...], bad: _Bad) -> ParamSlot:
    row = _row(value, 5, f"parameter {i}", bad)
    name, dtype = row[0], row[4]
    if not isinstance(name, str) or not 0 < len(name) <= 1024:
        raise bad(f"names parameter {i} {json.dumps(name)[:60]}")
    if dtype not in WIRE_DTYPES:
        raise bad(f"gives parameter {name!r} the dtype {json.dumps(dtype)[:30]}, not a wire dtype")
    alloc = _int(row, 1, 0, len(allocs) - 1, bad)
    offset = _int(row, 2, 0, 1 << 50, bad)
    nbytes = _int(row, 3, 0, 1 << 50, bad)
    if offset + nbytes > allocs[alloc].nbytes:
        raise bad(f"puts parameter {name!r} past the end of allocation {alloc}")
    return ParamSlot(name, alloc, offset, nbytes, dtype)


def _dims(value: Any, what: str, bad: _Bad, n: int | None = None) -> tuple[int, ...]:
    ok = isinstance(value, list) and len(value) <= MAX_NDIM and (n is None or len(value) == n)
    if not ok or not all(type(d) is int and 0 <= d < 1 << 50 for d in value):
        raise bad(f"has a malformed {what}: {json.dumps(value)[:80]}")
    return tuple(value)


def _tensor(value: Any, meta: ParamMeta, params: tuple[ParamSlot, ...], bad: _Bad) -> TensorLands:
    row = _row(value, 2, f"entry for {meta.name!r}", bad)
    if row[0] != meta.name:
        raise bad(f"lists {json.dumps(row[0])[:80]} where the round has {meta.name!r}")
    if not isinstance(row[1], list) or len(row[1]) > MAX_LANDINGS:
        raise bad(f"has no list of at most {MAX_LANDINGS} landings for {meta.name!r}")
    numel = meta.numel
    lands = []
    for x in row[1]:
        r = _row(x, 6, f"landing of {meta.name!r}", bad)
        p = _int(r, 0, 0, len(params) - 1, bad)
        shape = _dims(r[1], f"shape of a landing of {meta.name!r}", bad)
        land = Land(
            p,
            shape,
            _int(r, 2, 0, 1 << 50, bad),
            _dims(r[3], f"source strides of {meta.name!r}", bad, len(shape)),
            _int(r, 4, 0, 1 << 50, bad),
            _dims(r[5], f"destination strides of {meta.name!r}", bad, len(shape)),
        )
        slot = params[p]
        if not can_cast(meta.dtype, slot.dtype):
            raise bad(
                f"lands {meta.name!r} ({meta.dtype}) in {slot.name!r} ({slot.dtype}): a cast "
                "write-through does not do"
            )
        if _end(land.shape, land.src_offset, land.src_strides) > numel:
            raise bad(f"reads past the end of {meta.name!r} ({numel} elements)")
        item = WIRE_DTYPES[slot.dtype].itemsize
        if _end(land.shape, land.dst_offset, land.dst_strides) * item > slot.nbytes:
            raise bad(f"writes {meta.name!r} past the end of {slot.name!r}")
        if not _one_to_one(land.shape, land.src_strides):
            raise bad(
                f"reads elements of {meta.name!r} more than once in one landing (source "
                f"strides {list(land.src_strides)} for shape {list(land.shape)})"
            )
        if not _one_to_one(land.shape, land.dst_strides):
            raise bad(
                f"writes elements of {slot.name!r} more than once in one landing of "
                f"{meta.name!r} (destination strides {list(land.dst_strides)} for shape "
                f"{list(land.shape)})"
            )
        lands.append(land)
    return TensorLands(meta.name, tuple(lands))


def _end(shape: tuple[int, ...], offset: int, strides: tuple[int, ...]) -> int:
    """One past the last element a view reaches (its offset when it is empty)."""
    if any(d == 0 for d in shape):
        return offset
    return offset + sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) + 1


def _one_to_one(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Each stride (of a dim of size > 1) exceeds the reach of the smaller ones, so the view
    never names one element twice (a stride 0 repeats one)."""
    reach = 0
    for n, st in sorted((d for d in zip(shape, strides, strict=True) if d[0] > 1), key=_stride):
        if st <= reach:
            return False
        reach += st * (n - 1)
    return True


def _stride(dim: tuple[int, int]) -> int:
    return dim[1]


def _check_disjoint(
    params: tuple[ParamSlot, ...], tensors: tuple[TensorLands, ...], bad: _Bad
) -> None:
    """No parameter element is written by two landings: counted first (a parameter takes
    at most the elements it holds), then spans compared, and runs only where the spans of
    several landings interleave (column slices)."""
    spans: dict[int, list[tuple[int, int, str, Land]]] = {}
    for t in tensors:
        for land in t.lands:
            if math.prod(land.shape):
                end = _end(land.shape, land.dst_offset, land.dst_strides)
                spans.setdefault(land.param, []).append((land.dst_offset, end, t.name, land))
    for p, rows in spans.items():
        slot = params[p]
        holds = slot.nbytes // WIRE_DTYPES[slot.dtype].itemsize
        written = sum(math.prod(land.shape) for _, _, _, land in rows)
        if written > holds:
            raise bad(
                f"writes {written} elements into {slot.name!r}, which holds {holds}: its "
                "landings overlap"
            )
        rows.sort(key=lambda r: r[0])
        group, reach = [rows[0]], rows[0][1]
        for row in rows[1:]:
            if row[0] >= reach:
                _check_group(group, slot, bad)
                group = []
            group.append(row)
            reach = max(reach, row[1])
        _check_group(group, slot, bad)


def _check_group(rows: list[tuple[int, int, str, Land]], slot: ParamSlot, bad: _Bad) -> None:
    """Landings whose spans interleave write no element twice (their runs compared)."""
    if len(rows) < 2:
        return
    starts, ends, owners = [], [], []
    count = 0
    for i, (_, _, _, land) in enumerate(rows):
        dims = sorted(
            ((d, st) for d, st in zip(land.shape, land.dst_strides, strict=True) if d > 1),
            key=_stride,
        )
        inner, k = 1, 0
        while k < len(dims) and dims[k][1] == inner:
            inner *= dims[k][0]
            k += 1
        count += math.prod(land.shape) // inner
        if count > MAX_CHECK_RUNS:
            raise bad(
                f"interleaves {len(rows)} landings in {slot.name!r} in more than "
                f"{MAX_CHECK_RUNS} runs: too fine to check that they do not overlap"
            )
        at = np.array([land.dst_offset], dtype=np.int64)
        for d, st in dims[k:]:
            at = (at[:, None] + np.arange(d, dtype=np.int64) * st).ravel()
        starts.append(at)
        ends.append(at + inner)
        owners.append(np.full(at.size, i))
    start, end, owner = np.concatenate(starts), np.concatenate(ends), np.concatenate(owners)
    order = np.argsort(start, kind="stable")
    start, end, owner = start[order], end[order], owner[order]
    clash = np.flatnonzero(end[:-1] > start[1:])
    if clash.size:
        a, b = rows[int(owner[clash[0]])][2], rows[int(owner[clash[0] + 1])][2]
        raise bad(f"writes elements of {slot.name!r} twice (landings of {a!r} and {b!r} overlap)")


# -- copies ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """Contiguous bytes: ``nbytes`` from ``src`` (into the tensor) to ``dst`` (into alloc)."""

    src: int
    alloc: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class Strided:
    """A strided (or casting) copy of one landing; ``dst`` is element 0's byte offset."""

    src_offset: int
    src_dtype: str
    alloc: int
    dst: int
    dst_dtype: str
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TensorCopies:
    runs: tuple[Run, ...]
    strided: tuple[Strided, ...]


def plan_copies(table: LandingTable, metas: Sequence[ParamMeta]) -> list[TensorCopies]:
    """Per tensor of the round, the copies that land it (see the module docstring)."""
    out = []
    for t, meta in zip(table.tensors, metas, strict=True):
        runs: list[Run] = []
        strided: list[Strided] = []
        for land in t.lands:
            slot = table.params[land.param]
            cut = _runs(land, meta.dtype, slot) if meta.dtype == slot.dtype else None
            if cut is not None:
                runs.extend(cut)
                continue
            dst_item = WIRE_DTYPES[slot.dtype].itemsize
            strided.append(
                Strided(
                    land.src_offset,
                    meta.dtype,
                    slot.alloc,
                    slot.offset + land.dst_offset * dst_item,
                    slot.dtype,
                    land.shape,
                    land.src_strides,
                    land.dst_strides,
                )
            )
        out.append(TensorCopies(tuple(runs), tuple(strided)))
    return out


def _runs(land: Land, dtype: str, slot: ParamSlot) -> list[Run] | None:
    """``land`` as contiguous byte runs (same dtype both sides), or None when it cuts into
    too many or too short ones."""
    dims = [
        (d, s, t)
        for d, s, t in zip(land.shape, land.src_strides, land.dst_strides, strict=True)
        if d != 1
    ]
    if any(d == 0 for d, _, _ in dims):
        return []
    # The innermost dims where both sides are C-contiguous run together.
    inner, k = 1, len(dims)
    while k > 0 and dims[k - 1][1] == inner and dims[k - 1][2] == inner:
        inner *= dims[k - 1][0]
        k -= 1
    outer = dims[:k]
    item = WIRE_DTYPES[dtype].itemsize
    count = 1
    for d, _, _ in outer:
        count *= d
    if count > MAX_RUNS or (count > 1 and inner * item < MIN_RUN_BYTES):
        return None
    srcs, dsts = [land.src_offset], [land.dst_offset]
    for d, s, t in outer:
        srcs = [a + i * s for a in srcs for i in range(d)]
        dsts = [a + i * t for a in dsts for i in range(d)]
    base, n = slot.offset, inner * item
    return [Run(a * item, slot.alloc, base + b * item, n) for a, b in zip(srcs, dsts, strict=True)]
