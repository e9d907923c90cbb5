"""The wire dtype table: one row per dtype that may cross the wire.

Wire names are torch attribute spellings (``bfloat16``, ``float8_e4m3fn``), because a
stock vLLM worker resolves them with ``getattr(torch, name)``. Framework mappings
(jax, torch) live on their own sides; this table knows only numpy / ml_dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from weightwire.shared.errors import ConfigError
from weightwire.shared.limits import bounded_repr


@dataclass(frozen=True)
class WireDType:
    """One wire dtype: its name, host representation, byte width and NCCL enum."""

    name: str
    numpy: np.dtype
    itemsize: int
    nccl: int
    """``ncclDataType_t`` value used for unpacked (per-tensor) broadcasts."""


# ncclDataType_t values from nccl.h (stable ABI since NCCL 2.0; fp8 since 2.24 is not
# used: fp8 tensors travel as uint8 in unpacked mode, which NCCL treats identically).
_NCCL_INT8, _NCCL_UINT8, _NCCL_INT32, _NCCL_INT64 = 0, 1, 2, 4
_NCCL_FLOAT16, _NCCL_FLOAT32, _NCCL_FLOAT64, _NCCL_BFLOAT16 = 6, 7, 8, 9


def _row(name: str, dtype: DTypeLike, nccl: int) -> WireDType:
    np_dtype = np.dtype(dtype)
    return WireDType(name, np_dtype, np_dtype.itemsize, nccl)


WIRE_DTYPES: dict[str, WireDType] = {
    row.name: row
    for row in (
        _row("bfloat16", ml_dtypes.bfloat16, _NCCL_BFLOAT16),
        _row("float16", np.float16, _NCCL_FLOAT16),
        _row("float32", np.float32, _NCCL_FLOAT32),
        _row("float64", np.float64, _NCCL_FLOAT64),
        _row("int8", np.int8, _NCCL_INT8),
        _row("uint8", np.uint8, _NCCL_UINT8),
        _row("int32", np.int32, _NCCL_INT32),
        _row("int64", np.int64, _NCCL_INT64),
        _row("float8_e4m3fn", ml_dtypes.float8_e4m3fn, _NCCL_UINT8),
        _row("float8_e5m2", ml_dtypes.float8_e5m2, _NCCL_UINT8),
        _row("bool", np.bool_, _NCCL_UINT8),
    )
}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(WIRE_DTYPES)


def wire_dtype(name: object) -> WireDType:
    """Look up a wire dtype by name; unknown names raise naming the supported set."""
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise ConfigError(
            f"unsupported dtype {bounded_repr(name)}; "
            f"supported wire dtypes: {', '.join(SUPPORTED_DTYPES)}"
        )
    return WIRE_DTYPES[name]


def wire_name_of_numpy(dtype: np.dtype | type) -> str:
    """The wire name for a numpy / ml_dtypes dtype (``ValueError`` if none)."""
    np_dtype = np.dtype(dtype)
    for row in WIRE_DTYPES.values():
        if row.numpy == np_dtype:
            return row.name
    raise ConfigError(
        f"numpy dtype {np_dtype} has no wire name; supported: {', '.join(SUPPORTED_DTYPES)}"
    )
