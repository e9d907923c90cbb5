"""``SparsePatch``: one changed tensor of a delta round, and the wire tensors it becomes.

A delta round sends, per tensor that changed, the flat positions that changed and their
new values instead of the whole tensor. The record is framework-neutral: ``index`` and
``values`` are the trainer framework's own arrays (jax or torch, on the device where the
extraction ran); only their descriptions (``describe(array) -> (wire dtype, shape)``) are
read here.

On the wire a patch of tensor ``T`` is two ordinary tensors, adjacent, in this order:
``T@index`` (``int32``, shape ``[nnz]``: flat C-order positions into ``T``) and ``T@values``
(``T``'s dtype, shape ``[nnz]``): the delta wire of ``shared.delta``, whose ``Patch`` is the
metadata a weightwire worker is told; ``SparsePatch`` carries the arrays too. Every backend
moves them like any other tensor; what the receiver is told about them is the backend's
business (``Backend.plan_patches`` for a receiver of patches only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from weightwire.shared.delta import INDEX_DTYPE, INDEX_SUFFIX, MAX_PATCH_NUMEL, VALUES_SUFFIX
from weightwire.shared.errors import ConfigError
from weightwire.shared.limits import bounded_repr
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import Describe

__all__ = [
    "INDEX_DTYPE",
    "INDEX_SUFFIX",
    "MAX_PATCH_NUMEL",
    "VALUES_SUFFIX",
    "CheckedPatch",
    "EveryIndex",
    "SparsePatch",
    "check_patches",
    "wire_metas",
    "wire_pairs",
]


@dataclass(frozen=True)
class SparsePatch:
    """The changed elements of checkpoint tensor ``name`` (full shape ``shape``, wire
    dtype ``dtype``): ``index`` is a 1-D ``int32`` array of ``nnz`` flat C-order positions,
    strictly increasing; ``values`` a 1-D ``dtype`` array of the ``nnz`` new values, in the
    same order (``EveryIndex``: every element, made when sent). ``nnz >= 1``: a tensor that
    did not change is left out of the round."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    index: Any
    values: Any

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def wire_metas(self, nnz: int) -> tuple[ParamMeta, ParamMeta]:
        """The two wire tensors of this patch, in broadcast order."""
        return (
            ParamMeta(self.name + INDEX_SUFFIX, INDEX_DTYPE, (nnz,)),
            ParamMeta(self.name + VALUES_SUFFIX, self.dtype, (nnz,)),
        )


@dataclass(frozen=True)
class EveryIndex:
    """The index of a patch over every element, ``0..n-1``, made only as it is sent
    (``make(n, like)``: the framework's ``flat_index``), so an anchor round holds at most the
    indices in flight, not four bytes per element of the whole model."""

    n: int
    like: Any
    make: Callable[[int, Any], Any]

    def materialize(self) -> Any:
        return self.make(self.n, self.like)


@dataclass(frozen=True)
class CheckedPatch:
    """A patch whose arrays were described and found consistent with it."""

    patch: SparsePatch
    nnz: int

    @property
    def full(self) -> bool:
        """Every element of the tensor is in the patch (an anchor of that tensor)."""
        return self.nnz == self.patch.numel


def _nnz_of(patch: SparsePatch, describe: Describe) -> int:
    index_shape: tuple[int, ...]
    if isinstance(patch.index, EveryIndex):
        index_dtype, index_shape = INDEX_DTYPE, (patch.index.n,)
    else:
        index_dtype, index_shape = describe(patch.index)
    values_dtype, values_shape = describe(patch.values)
    if index_dtype != INDEX_DTYPE or len(index_shape) != 1:
        raise ConfigError(
            f"patch {patch.name!r}: index must be a 1-D {INDEX_DTYPE} array, "
            f"got {index_dtype} of shape {list(index_shape)}"
        )
    if values_dtype != patch.dtype or len(values_shape) != 1:
        raise ConfigError(
            f"patch {patch.name!r}: values must be a 1-D {patch.dtype} array (the tensor's "
            f"dtype), got {values_dtype} of shape {list(values_shape)}"
        )
    nnz = int(index_shape[0])
    if int(values_shape[0]) != nnz:
        raise ConfigError(f"patch {patch.name!r}: {nnz} indices but {int(values_shape[0])} values")
    if not 1 <= nnz <= patch.numel:
        raise ConfigError(
            f"patch {patch.name!r}: {nnz} changed elements for a tensor of {patch.numel} "
            "(a patch holds 1..numel elements; an unchanged tensor is left out)"
        )
    return nnz


def check_patches(patches: Sequence[SparsePatch], describe: Describe) -> list[CheckedPatch]:
    """Each patch's arrays against its declaration, before any byte is sent.

    Raises ``ConfigError`` naming the first patch that is wrong: not a ``SparsePatch``, a name
    given twice, an unknown dtype or a bad shape, a tensor too large for ``int32`` indices,
    arrays of the wrong dtype or rank, lengths that differ, or ``nnz`` outside ``1..numel``.
    The index *values* (range, order, uniqueness) are the extraction's promise; reading
    them here would cost a device round trip per patch.
    """
    out: list[CheckedPatch] = []
    seen: set[str] = set()
    for patch in patches:
        if not isinstance(patch, SparsePatch):
            raise ConfigError(
                f"a round's patches must be SparsePatch records, got {bounded_repr(patch)}"
            )
        if patch.name in seen:
            raise ConfigError(f"patch {patch.name!r} appears twice in one round")
        seen.add(patch.name)
        try:
            ParamMeta(patch.name, patch.dtype, patch.shape)
        except ValueError as exc:
            raise ConfigError(f"patch {patch.name!r}: {exc}") from None
        if patch.numel > MAX_PATCH_NUMEL:
            raise ConfigError(
                f"patch {patch.name!r}: {patch.numel} elements cannot be addressed by "
                f"{INDEX_DTYPE} flat indices (at most {MAX_PATCH_NUMEL})"
            )
        out.append(CheckedPatch(patch, _nnz_of(patch, describe)))
    return out


def wire_metas(checked: Sequence[CheckedPatch]) -> list[ParamMeta]:
    """The round's wire tensors in broadcast order: per patch ``T@index`` then ``T@values``."""
    return [meta for c in checked for meta in c.patch.wire_metas(c.nnz)]


def wire_pairs(checked: Sequence[CheckedPatch]) -> Iterator[tuple[str, Any]]:
    """The round's ``(wire name, array)`` pairs, in the order ``wire_metas`` lists them; an
    ``EveryIndex`` is made as its pair is pulled."""
    for c in checked:
        index = c.patch.index
        if isinstance(index, EveryIndex):
            index = index.materialize()
        yield c.patch.name + INDEX_SUFFIX, index
        yield c.patch.name + VALUES_SUFFIX, c.patch.values
