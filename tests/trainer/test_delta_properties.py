"""Property: the patches the trainer builds, applied to the base with numpy, give exactly
the new weights: any density from 0 to 100%, bf16 and float32 (NaN payloads, signed
zeros), biases, MoE expert stacks, scanned layer stacks, a head tied to the embedding;
JAX and torch kernels."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightwire.shared.delta import apply_patch
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.delta import DeltaTracker

SHAPES = {
    "model.embed_tokens.weight": (48, 8),
    "model.layers.0.self_attn.q_proj.bias": (8,),
    "model.layers.0.mlp.experts.w1": (4, 6, 8),  # MoE experts stacked
    "model.layers.scanned.mlp.up_proj.weight": (3, 8, 8),  # a scanned layer stack
    "model.norm.weight": (8,),
    "lm_head.weight": (48, 8),  # tied: the same array as the embedding
}
TIED = ("lm_head.weight", "model.embed_tokens.weight")


def to_framework(kind: str, array: np.ndarray) -> Any:
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(array)
    import torch

    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def to_host(kind: str, tensor: Any, dtype: np.dtype) -> np.ndarray:
    if kind == "jax":
        return np.asarray(tensor)
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).cpu().numpy().view(dtype)
    return tensor.cpu().numpy()


def kernel(kind: str) -> Any:
    if kind == "jax":
        from weightwire.jax_side.delta import JaxDeltaKernel

        return JaxDeltaKernel()
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    return TorchDeltaKernel()


def weights(rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
    out = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
    for array in out.values():
        array.reshape(-1)[0] = 0.0
    out[TIED[0]] = out[TIED[1]]
    return out


def stepped(
    rng: np.random.Generator, old: dict[str, np.ndarray], density: float
) -> dict[str, np.ndarray]:
    """``old`` with about ``density`` of each tensor's elements changed, some to NaN
    payloads and signed zeros (equal as floats to what they replace, not as bytes)."""
    new = {}
    for name, array in old.items():
        if name == TIED[0]:
            continue
        a = array.copy()
        flat = a.reshape(-1)
        picked = rng.random(flat.size) < density
        flat[picked] = (flat[picked].astype(np.float32) * 1.01 + 1e-3).astype(a.dtype)
        if density > 0:
            flat[0] = np.array(-0.0, a.dtype)  # == 0.0 as a float, other bytes
            flat[1] = np.array(np.nan, a.dtype)
        new[name] = a
    new[TIED[0]] = new[TIED[1]]
    return new


def metas_of(tensors: dict[str, np.ndarray]) -> list[ParamMeta]:
    names = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float32): "float32"}
    return [ParamMeta(n, names[a.dtype], a.shape) for n, a in tensors.items()]


@pytest.mark.parametrize("kind", ["jax", "torch"])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32], ids=["bf16", "f32"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    density=st.sampled_from([0.0, 0.001, 0.02, 0.2, 0.5, 1.0]) | st.floats(0, 1),
    threshold=st.sampled_from([0.05, 0.25, 1.0]),
)
def test_patches_applied_with_numpy_give_the_new_weights(
    kind: str, dtype: Any, seed: int, density: float, threshold: float
) -> None:
    rng = np.random.default_rng(seed)
    old = weights(rng, np.dtype(dtype))
    metas = metas_of(old)
    tracker = DeltaTracker(kernel(kind), density=threshold, anchor_every=0)
    framework = {n: to_framework(kind, a) for n, a in old.items()}
    framework[TIED[0]] = framework[TIED[1]]
    list(tracker.snapshot_stream(framework.items(), metas))
    new = stepped(rng, old, density)
    built = tracker.build([(n, to_framework(kind, a)) for n, a in new.items()], metas)
    assert built is not None
    got = {n: a.copy() for n, a in old.items()}
    wire = dict(built.pairs)
    for meta in built.metas:
        if "@" not in meta.name:
            got[meta.name] = to_host(kind, wire[meta.name], np.dtype(dtype)).reshape(meta.shape)
    host = {m.name: m for m in metas}
    for patch in built.patches:
        index = host_of(kind, wire[patch.index_name])
        values = host_of(kind, wire[patch.values_name], np.dtype(dtype))
        assert index.dtype == np.int32 and index.shape == values.shape == (patch.nnz,)
        assert np.all(np.diff(index.astype(np.int64)) > 0)
        assert patch.nnz <= threshold * host[patch.name].numel or patch.nnz == 1
        got[patch.name] = apply_patch(got[patch.name], index, values)
    assert {n: a.tobytes() for n, a in got.items()} == {n: a.tobytes() for n, a in new.items()}
    for name, base in tracker.bases.items():  # the base now is the new weights
        assert to_host(kind, base, np.dtype(dtype)).tobytes() == new[name].tobytes()


def host_of(kind: str, tensor: Any, dtype: np.dtype | None = None) -> np.ndarray:
    if kind == "jax":
        from weightwire.jax_side.delta import Prefix

        return tensor.host() if isinstance(tensor, Prefix) else np.asarray(tensor)
    return to_host(kind, tensor, dtype or np.dtype(np.int32))


@pytest.mark.parametrize("variant", ["jax-scatter", "torch-nonzero"])
def test_alternative_compactions_agree(variant: str) -> None:
    """The compactions the benchmark compares give the same patches."""
    from weightwire.jax_side.delta import JaxDeltaKernel
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    kind = variant.split("-")[0]
    alternative = JaxDeltaKernel("scatter") if kind == "jax" else TorchDeltaKernel("nonzero")
    rng = np.random.default_rng(7)
    old = weights(rng, np.dtype(ml_dtypes.bfloat16))
    new = stepped(rng, old, 0.05)
    metas = metas_of(old)
    results = []
    for k in (kernel(kind), alternative):
        tracker = DeltaTracker(k, density=0.25, anchor_every=0)
        list(tracker.snapshot_stream([(n, to_framework(kind, a)) for n, a in old.items()], metas))
        built = tracker.build([(n, to_framework(kind, a)) for n, a in new.items()], metas)
        assert built is not None
        results.append(
            {n: host_of(kind, t, np.dtype(ml_dtypes.bfloat16)).tobytes() for n, t in built.pairs}
        )
    assert results[0] == results[1] and len(results[0]) >= 10
