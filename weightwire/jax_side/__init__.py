"""JAX side of weightwire: naming rules, presets, ``PytreeSource``, ``JAXTrainerEngine``.

Import-light on purpose: importing this package loads neither jax nor torch; the names
below are resolved on first attribute access. Nothing under ``weightwire.jax_side`` may
depend on torch: a JAX trainer host usually has none.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "PytreeSource": "weightwire.jax_side.source",
    "preset": "weightwire.jax_side.presets",
    "Naming": "weightwire.jax_side.naming",
    "Rule": "weightwire.jax_side.naming",
    "NamingError": "weightwire.jax_side.naming",
    "JAXTrainerEngine": "weightwire.jax_side.engine",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
