"""JAX dtype <-> wire dtype name.

JAX dtypes are numpy / ml_dtypes dtypes, so the shared table is the single source of
truth; this module adds what is JAX-specific: 64-bit types exist only with
``jax_enable_x64``, and without it a cast to ``float64`` silently yields ``float32``.
Refusing that up front keeps a declared wire dtype from disagreeing with the bytes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np

from weightwire.shared.dtypes import SUPPORTED_DTYPES, wire_dtype
from weightwire.shared.errors import ConfigError

_X64_ONLY = frozenset({"float64", "int64"})


_NAMES: dict[Any, str] = {}  # dtype -> wire name: ``describe`` runs twice per tensor per round


def wire_name(dtype: Any) -> str:
    """The wire name of a JAX / numpy dtype; ``ConfigError`` (a ``ValueError``) naming the
    supported set."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype-like, resolved the slow way
        pass
    name = _wire_name(dtype)
    with contextlib.suppress(TypeError):
        _NAMES[dtype] = name
    return name


def _wire_name(dtype: Any) -> str:
    try:
        np_dtype = np.dtype(dtype)
    except TypeError as exc:
        raise ConfigError(
            f"{dtype!r} is not a dtype; supported wire dtypes: {', '.join(SUPPORTED_DTYPES)}"
        ) from exc
    for name in SUPPORTED_DTYPES:
        if wire_dtype(name).numpy == np_dtype:
            return name
    raise ConfigError(
        f"jax dtype {np_dtype} has no wire name; supported: {', '.join(SUPPORTED_DTYPES)}"
    )


def jax_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype JAX uses for ``dtype`` (a wire name or any dtype-like).

    Raises ``ValueError`` for names outside the wire table and for 64-bit dtypes while
    ``jax_enable_x64`` is off (JAX would quietly produce a 32-bit array instead).
    """
    name = dtype if isinstance(dtype, str) and dtype in SUPPORTED_DTYPES else wire_name(dtype)
    if name in _X64_ONLY and not jax.config.read("jax_enable_x64"):
        raise ConfigError(
            f"dtype {name} needs jax_enable_x64 (JAX would produce a 32-bit array instead)"
        )
    return wire_dtype(name).numpy


_ARRAY_TYPES: set[type] = set()
"""The concrete types of the ``jax.Array`` s seen so far (learnt, not imported: JAX's own is
private, and making an array to ask would start its backend before a multi-process
``jax.distributed.initialize``)."""


def is_array(x: Any) -> bool:
    """``isinstance(x, jax.Array)`` at a set lookup's cost once ``x``'s type was seen: the ABC
    check costs ~0.2 us, per tensor per round."""
    kind = type(x)
    if kind in _ARRAY_TYPES:
        return True
    if isinstance(x, jax.Array):
        _ARRAY_TYPES.add(kind)
        return True
    return False


def describe(array: Any) -> tuple[str, tuple[int, ...]]:
    """``(wire dtype name, shape)`` of an array or ShapeDtypeStruct, for ``checked_iter``."""
    if is_array(array):
        # Its abstract value holds both (its shape a tuple of ints): the array's own
        # ``dtype`` / ``shape`` properties cost 4x as much, and a round reads every tensor's.
        aval = array.aval
        return wire_name(aval.dtype), aval.shape
    return wire_name(array.dtype), tuple(map(int, array.shape))
