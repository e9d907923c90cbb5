"""The parameter pytree inside what JAX trainers actually hold.

``params_tree(obj)`` accepts a Flax NNX ``Module`` or ``nnx.State`` (its ``nnx.Param``
variables: RNG counters, batch-norm statistics and caches are not weights), an Equinox
``Module`` (its array leaves: activation functions, dropout rates and other static
fields are not), and returns anything else (a Linen variables dict, a ``FrozenDict``, a
MaxText-style scanned tree, a plain dict) as is. ``PytreeSource`` applies it to
whatever it is given, so ``PytreeSource(model, naming)`` works for all of them.

Duck-typed on purpose: Flax NNX and Equinox are recognised only when already imported
(an object of theirs cannot exist otherwise), so neither is ever imported here.

Leaf paths then read the same across kinds (``path_str``): NNX and Equinox lists give
``layers/3/...``, Linen ``layers_3/...``; the presets accept both.
"""

from __future__ import annotations

import sys
from typing import Any


def kind_of(obj: Any) -> str:
    """``"nnx-module"``, ``"nnx-state"``, ``"equinox"`` or ``"pytree"``."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:
        if isinstance(obj, nnx.Module):
            return "nnx-module"
        if isinstance(obj, nnx.State):
            return "nnx-state"
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(obj, eqx.Module):
        return "equinox"
    return "pytree"


def params_tree(obj: Any) -> Any:
    """The pytree of trainable arrays in ``obj`` (see the module docstring)."""
    kind = kind_of(obj)
    if kind == "pytree":
        return obj
    if kind == "equinox":
        eqx = sys.modules["equinox"]
        return eqx.filter(obj, eqx.is_array)
    nnx = sys.modules["flax.nnx"]
    if kind == "nnx-module":
        return nnx.state(obj, nnx.Param)
    return nnx.filter_state(obj, nnx.Param)
