"""The transforms a naming rule may apply between a pytree leaf and an HF tensor.

Every transform is a frozen dataclass: hashable, shape-generic and traceable, so the
source can key compiled ``jax.jit`` functions on (transform chain, input shapes, dtype)
and reuse one compilation for every layer of a model.

The second half holds the resolved plan (``Piece``/``Entry``/``Plan``) that
``naming.Naming.resolve`` produces and ``source.PytreeSource`` executes, and ``out_aval``:
a plan entry's output shape and dtype by abstract evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from weightwire.jax_side.dtypes import jax_dtype
from weightwire.shared.errors import ConfigError


class NamingError(ConfigError):
    """A mapping that cannot be right; the message names the leaf paths involved."""


class Op:
    """A shape-generic array transform; frozen subclasses so they key the jit cache."""

    def __call__(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError


@dataclass(frozen=True)
class Transpose(Op):
    """Permute axes; ``None`` reverses them (Flax ``kernel [in, out]`` -> HF ``weight [out,
    in]``)."""

    perm: tuple[int, ...] | None = None

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.transpose(x, self.perm)


@dataclass(frozen=True)
class Reshape(Op):
    """Reshape to a fixed shape (one ``-1`` allowed)."""

    shape: tuple[int, ...]

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.reshape(x, self.shape)


@dataclass(frozen=True)
class MergeAxes(Op):
    """Merge the consecutive axes ``first..last`` (inclusive) into one, e.g. DenseGeneral's
    ``[hidden, heads, head_dim]`` -> ``[hidden, heads * head_dim]``."""

    first: int
    last: int

    def __call__(self, x: jax.Array) -> jax.Array:
        first, last = self.first % x.ndim, self.last % x.ndim
        if last < first:
            raise NamingError(
                f"MergeAxes({self.first}, {self.last}) on rank {x.ndim}: last axis precedes first"
            )
        merged = 1
        for d in x.shape[first : last + 1]:
            merged *= d
        return jnp.reshape(x, (*x.shape[:first], merged, *x.shape[last + 1 :]))


@dataclass(frozen=True)
class AddScalar(Op):
    """Add a constant, e.g. ``-1.0`` when a JAX Gemma stores the full norm multiplier but
    HF stores its offset from one."""

    value: float

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.asarray(self.value, x.dtype)


@dataclass(frozen=True)
class Slice(Op):
    """Keep ``[start, stop)`` of one axis (emitted by ``Split``)."""

    axis: int
    start: int
    stop: int

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.lax.slice_in_dim(x, self.start, self.stop, axis=self.axis)


# ----------------------------------------------------------- structural rule parts
@dataclass(frozen=True)
class Stacked:
    """The leaf carries a leading (or ``axis``) stacked dimension, as scanned layers do:
    one HF tensor per index, ``{field}`` = index + ``offset`` in the target.

    A rule may stack several axes with distinct fields (a scanned MoE expert kernel
    ``[layers, experts, d, f]`` is ``Stacked(0), Stacked(1, field="expert")``); one HF
    tensor per index combination. ``axis`` counts in the leaf's own shape. Stacked
    parts come first in a rule."""

    axis: int = 0
    offset: int = 0
    field: str = "layer"


@dataclass(frozen=True)
class Split:
    """Unfuse: cut ``axis`` into ``sizes``, one piece per target template (in order).
    Transforms before the split apply to the whole leaf, those after it to each piece."""

    axis: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Concat:
    """Fuse: this leaf is part ``index`` of ``count`` concatenated along ``axis`` (after the
    rule's other transforms) into the target. Each part comes from its own rule."""

    axis: int
    index: int
    count: int


@dataclass(frozen=True)
class Cast:
    """Pin this rule's wire dtype, overriding the source-wide ``dtype``."""

    dtype: str


RulePart = Op | Stacked | Split | Concat | Cast


def run_entry(
    structure: tuple[Any, ...],
    xs: Sequence[jax.Array],
    idxs: Sequence[Sequence[Any]],
    out_dtype: Any,
) -> jax.Array:
    """Apply one entry's transform (traceable; used under ``jax.jit`` and ``jax.eval_shape``).

    ``idxs``: per piece, one index (int or traced scalar) per ``stack_axes`` entry."""
    pieces, concat_axis = structure
    parts = []
    for (stack_axes, ops), x, idx in zip(pieces, xs, idxs, strict=True):
        # Axes are indexed highest first (``Piece.stack_axes``), so each stays valid.
        for axis, i in zip(stack_axes, idx, strict=True):
            x = jax.lax.dynamic_index_in_dim(x, i, axis, keepdims=False)
        for op in ops:
            x = op(x)
        parts.append(x)
    y = parts[0] if concat_axis is None else jnp.concatenate(parts, axis=concat_axis)
    return y.astype(out_dtype)


def chain(ops: Sequence[Op], x: jax.Array) -> jax.Array:
    for op in ops:
        x = op(x)
    return x


@dataclass(frozen=True)
class Piece:
    """One input of an HF tensor: leaf ``leaf`` (flatten index), indexed at ``indices``
    along ``stack_axes`` (non-negative, highest first, so indexing one axis leaves the
    next valid; both empty for an unstacked leaf), then ``ops``."""

    leaf: int
    path: str
    indices: tuple[int, ...]
    stack_axes: tuple[int, ...]
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Entry:
    """One HF tensor: its pieces (several only when fused by ``Concat``)."""

    name: str
    pieces: tuple[Piece, ...]
    concat_axis: int | None
    cast: str | None

    @property
    def structure(self) -> tuple[Any, ...]:
        """Everything static about the transform (the jit cache key, with dtype and shapes)."""
        return (tuple((p.stack_axes, p.ops) for p in self.pieces), self.concat_axis)

    @property
    def is_identity(self) -> bool:
        return len(self.pieces) == 1 and not self.pieces[0].stack_axes and not self.pieces[0].ops


@dataclass(frozen=True)
class Plan:
    """A resolved mapping for one pytree structure (leaf shapes and dtypes included)."""

    treedef: Any
    paths: tuple[str, ...]
    avals: tuple[jax.ShapeDtypeStruct, ...]
    entries: tuple[Entry, ...]
    dropped: tuple[str, ...]

    def matches(self, treedef: Any, leaves: Sequence[Any]) -> bool:
        return treedef == self.treedef and all(
            tuple(x.shape) == a.shape and x.dtype == a.dtype
            for x, a in zip(leaves, self.avals, strict=True)
        )


_AVAL_CACHE: dict[tuple[Any, ...], jax.ShapeDtypeStruct] = {}


def out_aval(plan: Plan, entry: Entry, dtype: Any) -> jax.ShapeDtypeStruct:
    """The HF tensor's shape and dtype by abstract evaluation (no device work, no transfer).

    ``dtype``: the source-wide cast for float tensors (``None`` keeps the leaf dtype).
    Raises ``NamingError`` naming the leaf when a transform does not fit its shape.
    Cached per (transform structure, input shapes, dtype): metadata of an 80-layer model
    costs one abstract evaluation per distinct tensor kind, not per tensor.
    """
    ins = tuple(plan.avals[p.leaf] for p in entry.pieces)
    target = _out_dtype(entry, ins[0].dtype, dtype)
    key = (entry.structure, tuple((a.shape, a.dtype) for a in ins), target)
    hit = _AVAL_CACHE.get(key)
    if hit is not None:
        return hit
    idxs = tuple(
        tuple(jax.ShapeDtypeStruct((), jnp.int32) for _ in p.stack_axes) for p in entry.pieces
    )
    try:
        res = jax.eval_shape(lambda xs, ix: run_entry(entry.structure, xs, ix, target), ins, idxs)
    except NamingError:
        raise
    except Exception as exc:  # jax raises TypeError/ValueError variants; we re-raise with the paths
        raise NamingError(
            f"transform for HF name {entry.name!r} does not fit pytree leaf "
            f"{show_paths([p.path for p in entry.pieces])} of shape "
            f"{[list(a.shape) for a in ins]}: {exc}"
        ) from exc
    out = jax.ShapeDtypeStruct(tuple(res.shape), res.dtype)
    _AVAL_CACHE[key] = out
    return out


def out_avals(plan: Plan, dtype: Any) -> list[jax.ShapeDtypeStruct]:
    """``out_aval`` of every entry, in plan order.

    Entries cut from one stacked leaf by one rule (every expert of every layer) share
    their piece layout; they are looked up once, keyed by leaf and the identity of the
    rule's op chain, so an 18k-tensor MoE plan costs a few dozen cache lookups rather
    than hashing every transform tuple 18k times.
    """
    memo: dict[tuple[Any, ...], jax.ShapeDtypeStruct] = {}
    out = []
    for e in plan.entries:
        key = (e.concat_axis, e.cast, *((p.leaf, p.stack_axes, id(p.ops)) for p in e.pieces))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = out_aval(plan, e, dtype)
        out.append(hit)
    return out


def _out_dtype(entry: Entry, leaf_dtype: Any, dtype: Any) -> Any:
    if entry.cast is not None:
        return jax_dtype(entry.cast)
    if dtype is not None and jnp.issubdtype(leaf_dtype, jnp.floating):
        return jax_dtype(dtype)
    return leaf_dtype


def show_paths(paths: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(repr(p) for p in paths[:limit])
    return shown + (f" ... ({len(paths)} in all)" if len(paths) > limit else "")
