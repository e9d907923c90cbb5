"""torch <-> wire dtype names.

The wire spells dtypes as torch attribute names (``shared.dtypes``), so the mapping is
``getattr(torch, name)`` one way and a reverse table the other. It is spelled out
anyway because ``getattr`` on an untrusted name could return any torch attribute
(``torch.load``...); here only the rows of ``shared.dtypes.WIRE_DTYPES`` resolve.
"""

from __future__ import annotations

import torch

from weightwire.shared.dtypes import SUPPORTED_DTYPES, wire_dtype
from weightwire.shared.errors import ConfigError

_TO_TORCH: dict[str, torch.dtype] = {name: getattr(torch, name) for name in SUPPORTED_DTYPES}
_TO_WIRE: dict[torch.dtype, str] = {dtype: name for name, dtype in _TO_TORCH.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name; unknown names raise ``ValueError`` naming the set."""
    wire_dtype(name)  # raises with the supported list
    return _TO_TORCH[name]


def wire_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``ConfigError``, a ``ValueError``, for e.g. complex or
    float8_e4m3fnuz)."""
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise ConfigError(
            f"torch dtype {dtype} cannot cross the wire; supported: {', '.join(SUPPORTED_DTYPES)}"
        ) from None


def check_itemsizes() -> None:
    """Assert the torch and numpy byte widths agree for every wire dtype (tests call it)."""
    for name, dtype in _TO_TORCH.items():
        want = wire_dtype(name).itemsize
        got = torch.empty((), dtype=dtype).element_size()
        if got != want:
            raise AssertionError(f"{name}: torch itemsize {got} != wire itemsize {want}")
