"""``ParamMeta``: what one tensor on the wire is, declared before any byte moves."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar, overload

from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError
from weightwire.shared.limits import LIMITS, bounded_repr

T = TypeVar("T")


@dataclass(frozen=True)
class ParamMeta:
    """Name, wire dtype and full (unsharded) shape of one parameter.

    ``owners`` lists the trainer ranks that can produce the tensor (``None``: all).
    Validation happens at construction so a bad declaration fails on the trainer,
    before the worker has sized a single receive buffer from it.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(
                f"ParamMeta.name must be a non-empty string, got {bounded_repr(self.name)}"
            )
        if len(self.name) > LIMITS.max_name_length:
            raise ConfigError(
                f"ParamMeta.name is {len(self.name)} characters, "
                f"over the limit {LIMITS.max_name_length}"
            )
        try:
            row = wire_dtype(self.dtype)
        except ValueError as exc:
            raise ConfigError(f"dtype of {self.name!r}: {exc}") from None
        shape = validate_shape(self.shape, field=f"shape of {self.name!r}")
        object.__setattr__(self, "shape", shape)
        if row.itemsize * math.prod(shape) > LIMITS.max_tensor_bytes:
            raise ConfigError(
                f"shape of {self.name!r} {list(shape)} x {row.itemsize} bytes overflows the "
                f"per-tensor limit of {LIMITS.max_tensor_bytes} bytes"
            )
        if self.owners is not None:
            if not isinstance(self.owners, (list, tuple)):
                raise ConfigError(
                    f"owners of {self.name!r} must be a list of ints, "
                    f"got {bounded_repr(self.owners)}"
                )
            owners = tuple(self.owners)
            # bool is an int subclass: [True] is a caller bug, not rank 1.
            if not owners or not all(
                type(r) is int and 0 <= r < LIMITS.max_world_size for r in owners
            ):
                raise ConfigError(
                    f"owners of {self.name!r} must be a non-empty list of ranks in "
                    f"[0, {LIMITS.max_world_size}), got {bounded_repr(self.owners)}"
                )
            object.__setattr__(self, "owners", owners)

    @classmethod
    def trusted(cls, name: str, dtype: str, shape: Sequence[int]) -> ParamMeta:
        """A meta of fields already checked (an ``UpdateInfo``'s listing, a checked tensor's
        patch sizes): built without ``__post_init__``'s checks, as ``MetaRows`` reads them."""
        meta = object.__new__(cls)
        object.__setattr__(meta, "name", name)
        object.__setattr__(meta, "dtype", dtype)
        object.__setattr__(meta, "shape", tuple(shape))
        object.__setattr__(meta, "owners", None)
        return meta

    @property
    def itemsize(self) -> int:
        return wire_dtype(self.dtype).itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.owners is not None:
            out["owners"] = list(self.owners)
        return out

    @classmethod
    def from_dict(cls, data: object) -> ParamMeta:
        """Strict parse: unknown keys, missing fields and wrong types raise ``ValueError``."""
        if not isinstance(data, dict):
            raise ConfigError(f"ParamMeta must be a JSON object, got {type(data).__name__}")
        unknown = [k for k in data if k not in {"name", "dtype", "shape", "owners"}]
        if unknown:
            shown = ", ".join(bounded_repr(k) for k in sorted(unknown, key=str)[:5])
            raise ConfigError(
                f"ParamMeta: unknown keys [{shown}]; allowed: ['dtype', 'name', 'owners', 'shape']"
            )
        for key in ("name", "dtype", "shape"):
            if key not in data:
                raise ConfigError(f"ParamMeta: missing required field {key!r}")
        owners = data.get("owners")
        if owners is not None and not isinstance(owners, list):
            raise ConfigError(f"ParamMeta.owners must be a list, got {type(owners).__name__}")
        return cls(
            data["name"], data["dtype"], data["shape"], None if owners is None else tuple(owners)
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> ParamMeta:
        return cls.from_dict(load_json(text, "ParamMeta"))


class RowView(Sequence[T]):
    """A sequence of records held as rows of atoms (untracked by the collector), each record
    made as it is read: a round's listing or patches held through the round are then one
    object, not one per tensor (#49). A subclass says how many rows it has, how one row reads
    as its record and how a slice of rows reads; equal to a list of the same records."""

    __slots__ = ()

    def __len__(self) -> int:
        raise NotImplementedError

    def _row(self, i: int) -> T:
        raise NotImplementedError

    def _rows(self, i: slice) -> Self:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> Self: ...

    def __getitem__(self, i: int | slice) -> T | Self:
        return self._rows(i) if isinstance(i, slice) else self._row(i)

    def __iter__(self) -> Iterator[T]:
        return map(self._row, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (type(self), list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} rows)"


class MetaRows(RowView[ParamMeta]):
    """A round's wire listing as three parallel sequences (names, wire dtypes, shapes), each
    ``ParamMeta`` made as it is read (``ParamMeta.trusted``: the rows were checked already).

    A delta round's listing is new every round (its patch sizes change): as one ``ParamMeta``
    per wire tensor held through the round, they were objects its young collections promoted
    towards a full one (#49). The rows are the update info's own lists (a worker's, as
    parsed) or tuples of atoms (a trainer's), so the listing is one object, not one per
    tensor; a reader that keeps a meta keeps only that one."""

    __slots__ = ("names", "dtypes", "shapes")

    def __init__(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> None:
        if not len(names) == len(dtypes) == len(shapes):
            raise ConfigError(
                f"MetaRows: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes"
            )
        self.names, self.dtypes, self.shapes = names, dtypes, shapes

    def __len__(self) -> int:
        return len(self.names)

    def _row(self, i: int) -> ParamMeta:
        return ParamMeta.trusted(self.names[i], self.dtypes[i], self.shapes[i])

    def _rows(self, i: slice) -> MetaRows:
        return MetaRows(self.names[i], self.dtypes[i], self.shapes[i])

    def __iter__(self) -> Iterator[ParamMeta]:
        return map(ParamMeta.trusted, self.names, self.dtypes, self.shapes)


def load_json(text: object, ctx: str) -> object:
    """``json.loads`` that only ever raises ``ValueError`` (naming ``ctx``).

    The stdlib decoder raises ``RecursionError`` on deep nesting and ``TypeError`` on
    non-text input; a request handler that only expects ``ValueError`` would turn
    those into a crash instead of a clear rejection.
    """
    if not isinstance(text, (str, bytes, bytearray)):
        raise ConfigError(f"{ctx}: body must be JSON text, got {type(text).__name__}")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise ConfigError(f"{ctx}: body is not valid JSON ({reason})") from None


def validate_shape(shape: object, *, field: str = "shape") -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints; bools, floats and huge ranks refused."""
    if not isinstance(shape, (list, tuple)):
        raise ConfigError(f"{field} must be a list of ints, got {bounded_repr(shape)}")
    if len(shape) > LIMITS.max_rank:
        raise ConfigError(f"{field} has {len(shape)} dims, over the limit {LIMITS.max_rank}")
    dims: list[int] = []
    for dim in shape:
        # bool is an int subclass; a shape of [True] is a bug, not a 1.
        if type(dim) is not int:
            raise ConfigError(f"{field} has a non-integer dim {bounded_repr(dim)}")
        if dim < 0:
            raise ConfigError(f"{field} has a negative dim {dim}")
        if dim > LIMITS.max_tensor_bytes:
            raise ConfigError(
                f"{field} has dim {bounded_repr(dim)}, over the limit {LIMITS.max_tensor_bytes}"
            )
        dims.append(dim)
    return tuple(dims)
