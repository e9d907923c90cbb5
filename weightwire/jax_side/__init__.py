"""JAX side of weightwire: naming rules, presets, ``PytreeSource``, ``JAXTrainerEngine``.

Import-light on purpose: importing this package loads neither jax nor torch; the names
below are resolved on first attribute access. Nothing under ``weightwire.jax_side`` may
depend on torch: a JAX trainer host usually has none.
"""

from __future__ import annotations

from weightwire._extras import require
from weightwire._lazy import lazy_exports

# find_spec only (jax is not imported): a host without the extra learns which one to install.
require("jax", purpose="weightwire.jax_side")

_LAZY = {
    "PytreeSource": "weightwire.jax_side.source",
    "preset": "weightwire.jax_side.presets",
    "Naming": "weightwire.jax_side.naming",
    "Rule": "weightwire.jax_side.naming",
    "NamingError": "weightwire.jax_side.naming",
    "JAXTrainerEngine": "weightwire.jax_side.engine",
    "pytree_from_hf": "weightwire.jax_side.checkpoint",
    "load_decoder": "weightwire.jax_side.checkpoint",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
