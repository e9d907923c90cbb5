"""``ParamMeta``: what one tensor on the wire is, declared before any byte moves."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.limits import LIMITS


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
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if len(self.name) > LIMITS.max_name_length:
            raise ValueError(
                f"name is {len(self.name)} characters, over the limit {LIMITS.max_name_length}"
            )
        row = wire_dtype(self.dtype)
        shape = validate_shape(self.shape, field=f"shape of {self.name!r}")
        object.__setattr__(self, "shape", shape)
        if row.itemsize * math.prod(shape) > LIMITS.max_tensor_bytes:
            raise ValueError(
                f"shape of {self.name!r} {list(shape)} x {row.itemsize} bytes overflows the "
                f"per-tensor limit of {LIMITS.max_tensor_bytes} bytes"
            )
        if self.owners is not None:
            owners = tuple(self.owners)
            if not owners or not all(type(r) is int and r >= 0 for r in owners):
                raise ValueError(f"owners of {self.name!r} must be non-negative ints, got {owners}")
            object.__setattr__(self, "owners", owners)

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
    def from_dict(cls, data: dict[str, Any]) -> ParamMeta:
        if not isinstance(data, dict):
            raise ValueError(f"ParamMeta must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"name", "dtype", "shape", "owners"}
        if unknown:
            raise ValueError(f"unknown ParamMeta keys: {sorted(unknown)}")
        for key in ("name", "dtype", "shape"):
            if key not in data:
                raise ValueError(f"ParamMeta is missing field {key!r}")
        owners = data.get("owners")
        if owners is not None and not isinstance(owners, list):
            raise ValueError(f"owners must be a list, got {type(owners).__name__}")
        return cls(data["name"], data["dtype"], data["shape"], None if owners is None else tuple(owners))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> ParamMeta:
        return cls.from_dict(json.loads(text))


def validate_shape(shape: object, *, field: str = "shape") -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints; bools, floats and huge ranks refused."""
    if not isinstance(shape, (list, tuple)):
        raise ValueError(f"{field} must be a list of ints, got {type(shape).__name__}")
    if len(shape) > LIMITS.max_rank:
        raise ValueError(f"{field} has {len(shape)} dims, over the limit {LIMITS.max_rank}")
    dims: list[int] = []
    for dim in shape:
        # bool is an int subclass; a shape of [True] is a bug, not a 1.
        if type(dim) is not int:
            raise ValueError(f"{field} has a non-integer dim {dim!r}")
        if dim < 0:
            raise ValueError(f"{field} has a negative dim {dim}")
        if dim > LIMITS.max_tensor_bytes:
            raise ValueError(f"{field} has dim {dim}, over the limit {LIMITS.max_tensor_bytes}")
        dims.append(dim)
    return tuple(dims)
