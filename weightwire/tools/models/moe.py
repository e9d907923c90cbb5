"""Sparse mixture-of-experts MLP (Qwen2/Qwen3-MoE, Mixtral), numerically as HF computes it:
softmax router in float32, top-k, optional renormalisation of the kept weights, SwiGLU
experts, and (Qwen2-MoE) an always-on shared expert scaled by a sigmoid gate.

Parameters are laid out as the ``preset_layers.moe_rules`` expect: router
``{block}/gate/kernel [hidden, experts]`` and one stacked kernel per projection,
``{block}/experts/{proj}/kernel [experts, in, out]``. Every expert is computed for every
token (dense einsums, then the routing weights select): exact, simple, and fine for the
tiny models this exists to check; not how to serve a large MoE.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from weightwire.tools.models.common import dense_init


class _Stacked(nn.Module):
    """A bare ``kernel`` parameter of a given shape (one projection of every expert)."""

    shape: tuple[int, ...]
    param_dtype: Any

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("kernel", dense_init(), self.shape, self.param_dtype)


class MoE(nn.Module):
    """``cfg``: a ``DecoderConfig`` with ``num_experts > 0``; ``act``: the expert activation."""

    cfg: Any
    act: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        e, d, k = c.num_experts, c.hidden_size, c.num_experts_per_tok
        gate_n, up_n, down_n = (
            ("w1", "w3", "w2") if c.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        )
        dense = dict(
            use_bias=False, dtype=c.jdtype, param_dtype=c.jparam_dtype, kernel_init=dense_init()
        )
        logits = nn.Dense(e, name="gate", **dense)(x)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        top, idx = jax.lax.top_k(probs, k)
        if c.norm_topk_prob:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        top = top.astype(x.dtype)
        weights = jnp.sum(
            jax.nn.one_hot(idx, e, dtype=x.dtype) * top[..., None], axis=-2
        )  # [B, T, E]

        out = _Experts(c, gate_n, up_n, down_n, self.act, name="experts")(x, weights)
        if c.shared_expert_intermediate_size:
            s = c.shared_expert_intermediate_size
            shared = _SharedExpert(s, d, self.act, dense, name="shared_expert")(x)
            out = out + jax.nn.sigmoid(nn.Dense(1, name="shared_expert_gate", **dense)(x)) * shared
        return out


class _Experts(nn.Module):
    cfg: Any
    gate_n: str
    up_n: str
    down_n: str
    act: Any

    @nn.compact
    def __call__(self, x: jax.Array, weights: jax.Array) -> jax.Array:
        c = self.cfg
        e, d, m = c.num_experts, c.hidden_size, c.moe_intermediate_size_

        def w(name: str, shape: tuple[int, ...]) -> jax.Array:
            return _Stacked(shape, c.jparam_dtype, name=name)().astype(c.jdtype)

        g = jnp.einsum("btd,edm->btem", x, w(self.gate_n, (e, d, m)))
        u = jnp.einsum("btd,edm->btem", x, w(self.up_n, (e, d, m)))
        y = jnp.einsum("btem,emd->bted", self.act(g) * u, w(self.down_n, (e, m, d)))
        return jnp.einsum("bted,bte->btd", y, weights)


class _SharedExpert(nn.Module):
    inter: int
    hidden: int
    act: Any
    dense: dict

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = nn.Dense(self.inter, name="gate_proj", **self.dense)(x)
        up = nn.Dense(self.inter, name="up_proj", **self.dense)(x)
        return nn.Dense(self.hidden, name="down_proj", **self.dense)(self.act(gate) * up)
