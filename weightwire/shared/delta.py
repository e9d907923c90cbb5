"""Delta rounds on the wire: patch entries, their wire tensors, and a numpy reference.

A delta round sends, per changed tensor ``T``, either ``T`` itself (dense) or a patch:
two adjacent wire tensors ``T@index`` (``int32`` flat C-order indices into ``T``,
strictly increasing) and ``T@values`` (``T``'s dtype), both ``[nnz]``. The update info
lists the wire tensors in ``names`` / ``dtype_names`` / ``shapes`` as usual (every backend
carries them as ordinary tensors) and describes each patch in ``patches`` as
``[name, dtype_name, shape, nnz, encoding]``. Tensors that did not change are left out.

``check_patches`` is the strict validation ``UpdateInfo`` runs before any byte is
received; ``apply_patch`` is the numpy reference every receiver must match.
numpy-only, like the rest of ``weightwire.shared``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError
from weightwire.shared.limits import LIMITS, bounded_repr
from weightwire.shared.meta import RowView, validate_shape

INDEX_SUFFIX = "@index"
VALUES_SUFFIX = "@values"
FLAT_I32 = "flat_i32"
"""The one encoding: int32 flat indices into the tensor (C order), strictly increasing."""
ENCODINGS = (FLAT_I32,)
INDEX_DTYPE = "int32"
MAX_PATCH_NUMEL = 2**31 - 1
"""int32 indices address at most this many elements; a larger tensor is sent dense."""
MAX_TOKEN_LENGTH = 256


PatchEntry = tuple[str, str, tuple[int, ...], int, str]
"""A patch as its update-info entry: ``(name, dtype_name, shape, nnz, encoding)``."""


@dataclass(frozen=True)
class Patch:
    """One patched tensor of a delta round (an entry of ``UpdateInfo.patches``)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nnz: int
    encoding: str = FLAT_I32

    @property
    def index_name(self) -> str:
        return self.name + INDEX_SUFFIX

    @property
    def values_name(self) -> str:
        return self.name + VALUES_SUFFIX

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_list(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.nnz, self.encoding]

    def to_entry(self) -> PatchEntry:
        """``to_list`` as a tuple (JSON writes it the same): a round's entries, of atoms and a
        tuple of ints, are untracked by the first collection that sees them, so the young
        collections during the round never promote them towards a full one (#49)."""
        return (self.name, self.dtype, self.shape, self.nnz, self.encoding)


class PatchRows(RowView[Patch]):
    """A round's patches as their entries (``PatchEntry``: tuples of atoms, untracked by the
    collector), each ``Patch`` made as it is read: a worker's delta update holds no record
    per patch through the round (#49)."""

    __slots__ = ("entries",)

    def __init__(self, entries: Sequence[PatchEntry]) -> None:
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def _row(self, i: int) -> Patch:
        return Patch(*self.entries[i])

    def _rows(self, i: slice) -> PatchRows:
        return PatchRows(self.entries[i])


def check_token(field: str, value: str | None) -> None:
    """A round token: a non-empty printable string of at most ``MAX_TOKEN_LENGTH`` chars."""
    if value is None:
        return
    if not value or len(value) > MAX_TOKEN_LENGTH or not value.isprintable():
        raise ConfigError(
            f"{field} must be a non-empty printable string of <= {MAX_TOKEN_LENGTH} chars, "
            f"got {bounded_repr(value)}"
        )


def parse_patch(i: int, entry: object) -> Patch:
    """``patches[i]`` as a ``Patch``; every field checked (types, dtype, shape, nnz range)."""
    where = f"patches[{i}]"
    if not isinstance(entry, (list, tuple)) or len(entry) != 5:
        raise ConfigError(
            f"{where} must be [name, dtype_name, shape, nnz, encoding], got {bounded_repr(entry)}"
        )
    name, dtype, shape, nnz, encoding = entry
    if not isinstance(name, str) or not name or len(name) > LIMITS.max_name_length:
        raise ConfigError(
            f"{where} name must be a non-empty string of <= {LIMITS.max_name_length} chars"
        )
    if not isinstance(dtype, str):
        raise ConfigError(f"{where} dtype_name must be a string, got {bounded_repr(dtype)}")
    try:
        wire_dtype(dtype)
        dims = validate_shape(shape, field=f"{where} shape")
    except ValueError as exc:
        raise ConfigError(f"{where} ({name!r}): {exc}") from None
    if encoding not in ENCODINGS:
        raise ConfigError(
            f"{where} ({name!r}) encoding must be one of {list(ENCODINGS)}, "
            f"got {bounded_repr(encoding)}"
        )
    numel = math.prod(dims)
    if numel > MAX_PATCH_NUMEL:
        raise ConfigError(
            f"{where} ({name!r}) has {numel} elements, more than int32 indices address"
        )
    if type(nnz) is not int or not 1 <= nnz <= numel:
        raise ConfigError(
            f"{where} ({name!r}) nnz must be an int in [1, {numel}] (the tensor's elements), "
            f"got {bounded_repr(nnz)}"
        )
    return Patch(name, dtype, dims, nnz, encoding)


def check_patches(
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    patches: Sequence[object],
    *,
    delta_base: str | None,
    round_token: str | None,
) -> list[Patch]:
    """Validate a round's patches against its wire listing (already checked itself).

    Each patch's ``@index`` (``int32 [nnz]``) and ``@values`` (its dtype, ``[nnz]``) wire
    tensors are listed adjacent, in that order; no tensor is both dense and patched; no
    other wire name carries a patch suffix; ``delta_base`` (and ``round_token``) are set
    iff there are patches."""
    if not patches:
        if delta_base is not None:
            raise ConfigError("delta_base is set but the round has no patches")
        return []
    if delta_base is None:
        raise ConfigError("patches need delta_base (the round the patches were built on)")
    if round_token is None:
        raise ConfigError("a delta round needs round_token")
    position = {name: i for i, name in enumerate(names)}
    parsed = [parse_patch(i, entry) for i, entry in enumerate(patches)]
    claimed: set[str] = set()
    for i, p in enumerate(parsed):
        where = f"patches[{i}] ({p.name!r})"
        if p.name in claimed or p.index_name in claimed:
            raise ConfigError(f"{where}: the tensor is patched more than once")
        if p.name in position:
            raise ConfigError(f"{where}: the tensor is listed both dense and patched")
        at = position.get(p.index_name)
        if at is None or at + 1 >= len(names) or names[at + 1] != p.values_name:
            raise ConfigError(
                f"{where}: names must list {p.index_name!r} then {p.values_name!r}, adjacent"
            )
        _check_wire(where, p.index_name, dtype_names[at], shapes[at], INDEX_DTYPE, p.nnz)
        _check_wire(where, p.values_name, dtype_names[at + 1], shapes[at + 1], p.dtype, p.nnz)
        claimed.update((p.name, p.index_name, p.values_name))
    for name in names:
        if name.endswith((INDEX_SUFFIX, VALUES_SUFFIX)) and name not in claimed:
            raise ConfigError(f"names lists {name!r}, a patch wire tensor no patch describes")
    return parsed


def _check_wire(
    where: str, name: str, dtype: str, shape: Sequence[int], want_dtype: str, nnz: int
) -> None:
    if dtype != want_dtype or list(shape) != [nnz]:
        raise ConfigError(
            f"{where}: wire tensor {name!r} must be {want_dtype} [{nnz}], got {dtype} {list(shape)}"
        )


def apply_patch(base: np.ndarray, index: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The numpy reference: ``base`` with ``values`` written at the flat ``index`` (a copy).

    Bytes are written as they are (a view, not a cast), so NaN payloads and signed zeros
    land exactly."""
    out = np.array(base, copy=True, order="C")
    flat = out.reshape(-1)
    if values.dtype != flat.dtype:
        raise ConfigError(f"patch values are {values.dtype}, the tensor is {flat.dtype}")
    idx = np.asarray(index)
    if idx.size and (idx.min() < 0 or idx.max() >= flat.size):
        raise ConfigError(f"patch index out of range for a tensor of {flat.size} elements")
    if idx.size > 1 and bool((idx[1:] <= idx[:-1]).any()):
        raise ConfigError("patch indices must be strictly increasing (each element once, in order)")
    word = np.dtype(f"u{flat.dtype.itemsize}") if flat.dtype.itemsize in (1, 2, 4, 8) else None
    if word is None:
        flat[idx] = values
    else:
        flat.view(word)[idx] = values.view(word)
    return out


def extract_host(base: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference extraction: ``(int32 flat indices, values)`` of every element
    whose bytes differ between ``base`` and ``new`` (same dtype and shape)."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ConfigError(
            f"base is {base.dtype} {list(base.shape)}, new is {new.dtype} {list(new.shape)}"
        )
    word = np.dtype(f"u{new.dtype.itemsize}")
    a = np.ascontiguousarray(base).reshape(-1).view(word)
    b = np.ascontiguousarray(new).reshape(-1)
    index = np.flatnonzero(a != b.view(word)).astype(np.int32)
    return index, b[index]
