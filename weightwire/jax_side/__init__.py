"""JAX side of weightwire: naming rules, presets, ``PytreeSource``, ``JAXTrainerEngine``.

Import-light on purpose: importing this package loads neither jax nor torch; the names
below are resolved on first attribute access. Nothing under ``weightwire.jax_side`` may
depend on torch: a JAX trainer host usually has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightwire._extras import require
from weightwire._lazy import attach

# find_spec only (jax is not imported): a host without the extra learns which one to install.
require("jax", purpose="weightwire.jax_side")

if TYPE_CHECKING:  # the export list (``weightwire._lazy``): each name is imported on first use
    from weightwire.jax_side.checkpoint import CheckpointError as CheckpointError
    from weightwire.jax_side.checkpoint import pytree_from_hf as pytree_from_hf
    from weightwire.jax_side.checkpoint import read_safetensors as read_safetensors
    from weightwire.jax_side.engine import JAXTrainerEngine as JAXTrainerEngine
    from weightwire.jax_side.naming import MergeAxes as MergeAxes
    from weightwire.jax_side.naming import Naming as Naming
    from weightwire.jax_side.naming import NamingError as NamingError
    from weightwire.jax_side.naming import Stacked as Stacked
    from weightwire.jax_side.naming import Transpose as Transpose
    from weightwire.jax_side.presets import preset as preset
    from weightwire.jax_side.presets import register_family as register_family
    from weightwire.jax_side.rules import Rule as Rule
    from weightwire.jax_side.rules import drop as drop
    from weightwire.jax_side.source import PytreeSource as PytreeSource

__getattr__, __dir__ = attach(__name__, globals())
