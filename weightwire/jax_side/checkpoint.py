"""Load a Hugging Face checkpoint directory into a Flax pytree: a preset run backwards.

A JAX trainer (and the demo's policy) must start from exactly the weights the server
serves, so this reads the server's own ``model.safetensors`` and maps HF names back
onto pytree leaves: ``pytree_from_hf(naming, template, tensors)``, or
``tools.models.loading.load_decoder(model_dir)`` builds the reference decoder models on it.

There is no hand-written inverse per preset. A naming plan's forward map (leaves ->
HF tensors) only rearranges elements (transpose, reshape, split, concat, stack) and
at most adds a constant (Gemma's norm offset), so it is ``y = A x + b`` with ``A`` a
permutation. Its inverse is therefore ``x = A^T (y - b)``, and ``A^T`` is exactly the
vector-Jacobian product JAX derives from the forward map. That keeps every preset,
scanned (MaxText-style) layouts included, invertible by construction, and a final
forward pass checks the round trip bit for bit, which rejects any mapping that is
not a permutation (a leaf sent twice would come back doubled) instead of loading
wrong weights silently.

Torch-free: safetensors is read with its numpy reader (bf16 through ml_dtypes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from weightwire._extras import require
from weightwire.jax_side.naming import Naming, Plan
from weightwire.jax_side.transforms import run_entry
from weightwire.shared.errors import ConfigError


class CheckpointError(ConfigError):
    """The checkpoint directory does not fit the model / naming it is loaded into."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{model_dir} has no config.json (is it a Hugging Face model directory?)"
        )
    return json.loads(path.read_text())


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of every ``*.safetensors`` shard in ``model_dir``, as numpy arrays."""
    require("safetensors", purpose="reading a checkpoint")
    from safetensors.numpy import load_file  # optional dependency, torch-free

    shards = sorted(Path(model_dir).glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir} has no *.safetensors files")
    out: dict[str, np.ndarray] = {}
    for shard in shards:
        for name, array in load_file(str(shard)).items():
            if name in out:
                raise CheckpointError(
                    f"tensor {name!r} appears in more than one shard of {model_dir}"
                )
            out[name] = array
    return out


def _forward(plan: Plan, leaves: list[jax.Array]) -> dict[str, jax.Array]:
    out = {}
    for entry in plan.entries:
        xs = [leaves[p.leaf] for p in entry.pieces]
        idxs = [p.indices for p in entry.pieces]
        out[entry.name] = run_entry(entry.structure, xs, idxs, xs[0].dtype)
    return out


def pytree_from_hf(naming: Naming, template: Any, tensors: Mapping[str, Any]) -> Any:
    """Invert ``naming`` on ``template``'s structure: HF ``tensors`` -> a pytree shaped
    like ``template`` (arrays or ``ShapeDtypeStruct``; leaf dtypes are kept).

    Raises ``CheckpointError`` naming missing / unexpected tensors or shape mismatches;
    leaves the naming drops (target ``None``) come from ``template`` if it holds arrays,
    else zeros.
    """
    plan = naming.resolve(template)
    leaves_t, treedef = jax.tree_util.tree_flatten(template)
    want = {e.name for e in plan.entries}
    missing = sorted(want - set(tensors))
    if missing:
        raise CheckpointError(
            f"checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:4]}"
        )
    extra = sorted(set(tensors) - want)
    if extra:
        raise CheckpointError(
            f"checkpoint has {len(extra)} tensor(s) the model does not map, e.g. {extra[:4]}"
        )
    zeros = [jnp.zeros(x.shape, x.dtype) for x in leaves_t]
    offset, vjp = jax.vjp(lambda ls: _forward(plan, ls), zeros)
    target = {}
    for name, want_aval in offset.items():
        got = np.asarray(tensors[name])
        if tuple(got.shape) != tuple(want_aval.shape):
            raise CheckpointError(
                f"{name}: checkpoint shape {list(got.shape)}, model expects {list(want_aval.shape)}"
            )
        target[name] = jnp.asarray(got).astype(want_aval.dtype) - offset[name]
    (leaves,) = vjp(target)
    dropped = set(plan.dropped)
    for i, path in enumerate(plan.paths):
        if path in dropped and isinstance(leaves_t[i], jax.Array):
            leaves[i] = leaves_t[i]
    # Guard: a Naming only ever partitions and rearranges leaves, so this holds by
    # construction; if a future transform breaks that, refuse rather than load garbage.
    back = _forward(plan, leaves)
    for name, y in back.items():
        ref = jnp.asarray(np.asarray(tensors[name])).astype(y.dtype)
        if not bool(jnp.array_equal(y, ref)):
            raise CheckpointError(
                f"the naming does not map leaves to {name!r} one-to-one (a leaf used twice or a "
                "lossy transform); it cannot be inverted to load this checkpoint"
            )
    return jax.tree_util.tree_unflatten(treedef, leaves)
