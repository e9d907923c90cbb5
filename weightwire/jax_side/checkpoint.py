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
from weightwire.jax_side.transforms import Entry, run_entry
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


def _components(plan: Plan) -> list[tuple[list[int], list[Entry]]]:
    """The plan cut into independent parts: leaves and the HF tensors made from them, two
    tensors in one part when they share a leaf (a fused or stacked leaf feeds several)."""
    parent = list(range(len(plan.avals)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for entry in plan.entries:
        first = root(entry.pieces[0].leaf)
        for piece in entry.pieces[1:]:
            parent[root(piece.leaf)] = first
    parts: dict[int, tuple[list[int], list[Entry]]] = {}
    for entry in plan.entries:
        parts.setdefault(root(entry.pieces[0].leaf), ([], []))[1].append(entry)
    for leaf in range(len(plan.avals)):
        part = parts.get(root(leaf))
        if part is not None:
            part[0].append(leaf)
    return list(parts.values())


def _forward(entries: list[Entry], at: dict[int, int], leaves: list[jax.Array]) -> dict[str, Any]:
    """The HF tensors of ``entries`` from ``leaves`` (leaf ``i`` of the plan is
    ``leaves[at[i]]``)."""
    out = {}
    for entry in entries:
        xs = [leaves[at[p.leaf]] for p in entry.pieces]
        idxs = [p.indices for p in entry.pieces]
        out[entry.name] = run_entry(entry.structure, xs, idxs, xs[0].dtype)
    return out


def pytree_from_hf(naming: Naming, template: Any, tensors: Mapping[str, Any]) -> Any:
    """Invert ``naming`` on ``template``'s structure: HF ``tensors`` -> a pytree shaped
    like ``template`` (arrays or ``ShapeDtypeStruct``; leaf dtypes are kept).

    Raises ``CheckpointError`` naming missing / unexpected tensors or shape mismatches;
    leaves the naming drops (target ``None``) come from ``template`` if it holds arrays,
    else zeros. Device memory: the loaded pytree plus one part of it at a time (a leaf and
    the tensors made from it), not several copies of the model.
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
    dropped = set(plan.dropped)
    leaves: list[Any] = [
        leaves_t[i]
        if plan.paths[i] in dropped and isinstance(leaves_t[i], jax.Array)
        else jnp.zeros(a.shape, a.dtype)
        for i, a in enumerate(plan.avals)
    ]
    for part_leaves, entries in _components(plan):
        got = _invert(plan, part_leaves, entries, tensors)
        for i, x in zip(part_leaves, got, strict=True):
            leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _invert(
    plan: Plan, part: list[int], entries: list[Entry], tensors: Mapping[str, Any]
) -> list[jax.Array]:
    """One part's leaves from its HF tensors: the forward map is a permutation plus a
    constant, so the leaves are its transpose (``jax.vjp``) applied to ``tensor - f(0)``."""
    at = {leaf: k for k, leaf in enumerate(part)}
    zeros = [jnp.zeros(plan.avals[i].shape, plan.avals[i].dtype) for i in part]
    offset, vjp = jax.vjp(lambda ls: _forward(entries, at, ls), zeros)
    target = {}
    for name, want_aval in offset.items():
        got = np.asarray(tensors[name])
        if tuple(got.shape) != tuple(want_aval.shape):
            raise CheckpointError(
                f"{name}: checkpoint shape {list(got.shape)}, model expects {list(want_aval.shape)}"
            )
        target[name] = jnp.asarray(got).astype(want_aval.dtype) - offset[name]
    (leaves,) = vjp(target)
    del target, offset, vjp, zeros
    # Guard: a Naming only ever partitions and rearranges leaves, so this holds by
    # construction; if a future transform breaks that, refuse rather than load garbage.
    back = _forward(entries, at, leaves)
    for name, y in back.items():
        ref = jnp.asarray(np.asarray(tensors[name])).astype(y.dtype)
        if not bool(jnp.array_equal(y, ref)):
            raise CheckpointError(
                f"the naming does not map leaves to {name!r} one-to-one (a leaf used twice or a "
                "lossy transform); it cannot be inverted to load this checkpoint"
            )
    return list(leaves)
