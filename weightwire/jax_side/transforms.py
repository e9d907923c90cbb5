"""The transforms a naming rule may apply between a pytree leaf and an HF tensor.

Every transform is a frozen dataclass: hashable, shape-generic and traceable, so the
source can key compiled ``jax.jit`` functions on (transform chain, input shapes, dtype)
and reuse one compilation for every layer of a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


class Op:
    """A shape-generic array transform; frozen subclasses so they key the jit cache."""

    def __call__(self, x: jax.Array) -> jax.Array:
        raise NotImplementedError


@dataclass(frozen=True)
class Transpose(Op):
    """Permute axes; ``None`` reverses them (Flax ``kernel [in, out]`` -> HF ``weight [out, in]``)."""

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
            raise ValueError(f"MergeAxes({self.first}, {self.last}) on rank {x.ndim}: last axis precedes first")
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
    """The leaf carries a leading (or ``axis``) layer dimension, as scanned layers do:
    one HF tensor per index, ``{layer}`` = index + ``offset``. Must be a rule's first part."""

    axis: int = 0
    offset: int = 0


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


def run_entry(structure: tuple[Any, ...], xs: Sequence[jax.Array], idxs: Sequence[jax.Array | None],
              out_dtype: Any) -> jax.Array:
    """Apply one entry's transform (traceable; used under ``jax.jit`` and ``jax.eval_shape``)."""
    pieces, concat_axis = structure
    parts = []
    for (stack_axis, ops), x, idx in zip(pieces, xs, idxs, strict=True):
        if stack_axis is not None:
            x = jax.lax.dynamic_index_in_dim(x, idx, stack_axis, keepdims=False)
        for op in ops:
            x = op(x)
        parts.append(x)
    y = parts[0] if concat_axis is None else jnp.concatenate(parts, axis=concat_axis)
    return y.astype(out_dtype)


def chain(ops: Sequence[Op], x: jax.Array) -> jax.Array:
    for op in ops:
        x = op(x)
    return x
