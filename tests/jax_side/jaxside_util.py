"""Helpers shared by the jax_side tests (no torch here)."""

from __future__ import annotations

from typing import Any

import jax


def perturbed(params: Any, seed: int = 1, scale: float = 0.1) -> Any:
    """``params`` plus noise on every leaf, so norms and biases are not at their trivial
    init values (a mapping that drops or swaps them must change the logits)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            x + scale * jax.random.normal(k, x.shape, x.dtype)
            for k, x in zip(keys, leaves, strict=True)
        ],
    )
