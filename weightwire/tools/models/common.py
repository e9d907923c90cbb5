"""Numerics shared by the reference models, written to match Hugging Face's torch code
operation for operation (same casts, same rotary convention), so a mapped checkpoint
gives the same logits in both frameworks. Linen layers here are kept tiny on purpose:
they exist so tests and demos can prove the naming layer, not to be fast.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

INIT_STD = 0.02
"""Hugging Face's default ``initializer_range``."""


def dense_init() -> nn.initializers.Initializer:
    return nn.initializers.normal(INIT_STD)


def dense(features: int, *, name: str, dtype: Any, param_dtype: Any, bias: bool = True) -> nn.Dense:
    """A projection initialised as Hugging Face's models are (normal(0.02) kernel)."""
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=dense_init(),
        name=name,
    )


def embed(num: int, features: int, *, dtype: Any, param_dtype: Any) -> nn.Embed:
    """An embedding table initialised as Hugging Face's models are (normal(0.02))."""
    return nn.Embed(
        num, features, dtype=dtype, param_dtype=param_dtype, embedding_init=dense_init()
    )


class RMSNorm(nn.Module):
    """RMS norm over the last axis.

    ``gemma_style=False`` (Llama/Qwen): ``scale * normed.astype(x.dtype)``.
    ``gemma_style=True``: ``(normed * (1 + scale)).astype(x.dtype)`` in float32, with the
    parameter stored as the offset from one (Gemma's checkpoint convention).
    """

    eps: float = 1e-6
    gemma_style: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.gemma_style else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.param_dtype)
        xf = x.astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.gemma_style:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        return scale.astype(self.dtype) * normed.astype(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Inverse rotary frequencies (float32), ``default`` or ``llama3`` scaling."""
    inv = (
        1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    ).astype(np.float32)
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv
    if kind != "llama3":
        raise NotImplementedError(
            f"rope_type {kind!r} is not implemented by the reference models (default, llama3)"
        )
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary(positions: jax.Array, inv_freq: np.ndarray, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of shape ``[B, T, head_dim]`` in ``dtype`` (HF's cat(freqs, freqs))."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x``: ``[B, T, heads, D]``; cos/sin ``[B, T, D]``."""
    return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]


def attention_bias(tokens: jax.Array, attention_mask: jax.Array | None, dtype: Any) -> jax.Array:
    """Additive ``[B, 1, T, T]`` bias: causal, plus padding keys masked out."""
    t = tokens.shape[1]
    allowed = jnp.tril(jnp.ones((t, t), dtype=bool))[None, None]
    if attention_mask is not None:
        allowed = allowed & (attention_mask.astype(bool)[:, None, None, :])
    return jnp.where(allowed, 0.0, jnp.finfo(dtype).min).astype(dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, scaling: float) -> jax.Array:
    """Grouped-query attention: q ``[B,T,H,D]``, k/v ``[B,T,KV,D]`` -> ``[B,T,H*D]``.

    Softmax runs in float32 then casts back, as HF's eager attention does.
    """
    groups = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, groups, axis=2)
    v = jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) * jnp.asarray(scaling, q.dtype) + bias
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    out = jnp.einsum("bhts,bshd->bthd", probs, v)
    return out.reshape(*out.shape[:2], -1)


def positions_for(tokens: jax.Array, positions: jax.Array | None) -> jax.Array:
    if positions is not None:
        return positions
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def init_params(lm: nn.Module, rng: jax.Array) -> dict[str, Any]:
    """Random parameters ``{"params": {...}}`` of a causal LM module, traced on one token."""
    # A plain dict: flax returns a FrozenDict only when flax_return_frozendict is set.
    return cast(dict[str, Any], lm.init(rng, jnp.zeros((1, 1), jnp.int32)))


def lm_logits(
    lm: nn.Module,
    params: Any,
    tokens: jax.Array,
    positions: jax.Array | None,
    attention_mask: jax.Array | None,
) -> jax.Array:
    """A causal LM module's logits ``[B, T, vocab]`` for ``tokens [B, T]``."""
    # Without mutable=..., apply returns the output alone (no (output, state) pair).
    return cast(jax.Array, lm.apply(params, tokens, positions, attention_mask))
