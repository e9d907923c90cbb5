"""One Linen decoder covering the Llama-like families (Llama/Mistral, Qwen2, Qwen3, Gemma,
Phi-3) and their mixture-of-experts variants (Qwen2-MoE, Qwen3-MoE, Mixtral; ``moe.py``).

The differences between these families are switches on ``DecoderConfig`` (biases, q/k
norms, Gemma's norm and embedding conventions, activation). Parameter paths mirror HF
names (``params/model/layers_0/self_attn/q_proj/kernel``), and three JAX-side layout
switches exist only to exercise the naming layer's transforms against a real model:
``scan_layers`` (one stacked ``layers`` subtree), ``fused_qkv`` / ``fused_gate_up`` (one
Dense where HF has several Linear), ``head_axes`` (DenseGeneral with explicit head axes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from weightwire.jax_side.naming import Naming
from weightwire.jax_side.presets import preset
from weightwire.tools.models.common import (
    RMSNorm,
    apply_rotary,
    attend,
    attention_bias,
    dense,
    dense_init,
    embed,
    init_params,
    lm_logits,
    positions_for,
    rope_inv_freq,
    rotary,
)
from weightwire.tools.models.decoder_config import ACTIVATIONS, FAMILIES, DecoderConfig
from weightwire.tools.models.moe import MoE

__all__ = ["FAMILIES", "DecoderConfig", "apply", "family_config", "init", "naming"]


def _dense(cfg: DecoderConfig, features: int, name: str, bias: bool) -> nn.Dense:
    return dense(features, name=name, bias=bias, dtype=cfg.jdtype, param_dtype=cfg.jparam_dtype)


def _norm(cfg: DecoderConfig, name: str) -> RMSNorm:
    return RMSNorm(cfg.rms_norm_eps, cfg.gemma_norm, cfg.jdtype, cfg.jparam_dtype, name=name)


class Attention(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.cfg
        heads, kv, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim_
        b, t = x.shape[:2]
        qkv_bias = c.qkv_bias or c.attention_bias
        if c.fused_qkv:
            qkv = _dense(c, (heads + 2 * kv) * dim, "qkv_proj", qkv_bias)(x)
            q, k, v = jnp.split(qkv, [heads * dim, (heads + kv) * dim], axis=-1)
        elif c.head_axes:

            def general(n: int, name: str) -> nn.DenseGeneral:
                return nn.DenseGeneral(
                    (n, dim),
                    axis=-1,
                    use_bias=qkv_bias,
                    dtype=c.jdtype,
                    param_dtype=c.jparam_dtype,
                    kernel_init=dense_init(),
                    name=name,
                )

            q, k, v = (
                general(heads, "q_proj")(x),
                general(kv, "k_proj")(x),
                general(kv, "v_proj")(x),
            )
        else:
            q = _dense(c, heads * dim, "q_proj", qkv_bias)(x)
            k = _dense(c, kv * dim, "k_proj", qkv_bias)(x)
            v = _dense(c, kv * dim, "v_proj", qkv_bias)(x)
        q, k, v = q.reshape(b, t, heads, dim), k.reshape(b, t, kv, dim), v.reshape(b, t, kv, dim)
        if c.qk_norm:
            q, k = _norm(c, "q_norm")(q), _norm(c, "k_norm")(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v, bias, dim**-0.5)
        if c.head_axes:
            return nn.DenseGeneral(
                c.hidden_size,
                axis=(-2, -1),
                use_bias=c.attention_bias,
                dtype=c.jdtype,
                param_dtype=c.jparam_dtype,
                kernel_init=dense_init(),
                name="o_proj",
            )(out.reshape(b, t, heads, dim))
        return _dense(c, c.hidden_size, "o_proj", c.attention_bias)(out)


class MLP(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        if c.fused_gate_up:
            gate, up = jnp.split(
                _dense(c, 2 * c.intermediate_size, "gate_up_proj", c.mlp_bias)(x), 2, axis=-1
            )
        else:
            gate = _dense(c, c.intermediate_size, "gate_proj", c.mlp_bias)(x)
            up = _dense(c, c.intermediate_size, "up_proj", c.mlp_bias)(x)
        return _dense(c, c.hidden_size, "down_proj", c.mlp_bias)(
            ACTIVATIONS[c.hidden_act](gate) * up
        )


class DecoderLayer(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.cfg
        x = x + Attention(c, name="self_attn")(_norm(c, "input_layernorm")(x), cos, sin, bias)
        h = _norm(c, "post_attention_layernorm")(x)
        if c.num_experts:
            block = "block_sparse_moe" if c.family == "mixtral" else "mlp"
            return x + MoE(c, ACTIVATIONS[c.hidden_act], name=block)(h)
        return x + MLP(c, name="mlp")(h)


class _ScannedLayer(DecoderLayer):
    """``DecoderLayer`` in ``nn.scan``'s carry form."""

    # Unannotated on purpose: nn.scan's carry form returns (carry, None), not DecoderLayer's Array.
    def __call__(self, x, cos, sin, bias):
        return super().__call__(x, cos, sin, bias), None


class DecoderModel(nn.Module):
    cfg: DecoderConfig

    def setup(self) -> None:
        c = self.cfg
        self.embed_tokens = embed(
            c.vocab_size, c.hidden_size, dtype=c.jdtype, param_dtype=c.jparam_dtype
        )
        if c.scan_layers:
            stack = nn.scan(
                _ScannedLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                length=c.num_hidden_layers,
            )
            # One scanned module or a list of layers, by cfg.scan_layers (flax setup attribute).
            self.layers: Any = stack(c)
        else:
            self.layers = [DecoderLayer(c) for _ in range(c.num_hidden_layers)]
        self.norm = _norm(c, "norm")

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None, attention_mask: jax.Array | None
    ) -> jax.Array:
        c = self.cfg
        x = self.embed_tokens(tokens)
        if c.embed_scale:
            x = x * jnp.asarray(np.float32(math.sqrt(c.hidden_size))).astype(x.dtype)
        cos, sin = rotary(
            positions_for(tokens, positions),
            rope_inv_freq(c.head_dim_, c.rope_theta, c.rope_scaling_dict),
            x.dtype,
        )
        bias = attention_bias(tokens, attention_mask, x.dtype)
        if c.scan_layers:
            x, _ = self.layers(x, cos, sin, bias)
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, bias)
        return self.norm(x)

    def attend(self, h: jax.Array) -> jax.Array:
        return self.embed_tokens.attend(h)


class CausalLM(nn.Module):
    cfg: DecoderConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
    ) -> jax.Array:
        model = DecoderModel(self.cfg, name="model")
        h = model(tokens, positions, attention_mask)
        if self.cfg.tie_word_embeddings:
            return model.attend(h)
        return _dense(self.cfg, self.cfg.vocab_size, "lm_head", False)(h)


def init(rng: jax.Array, cfg: DecoderConfig) -> dict[str, Any]:
    """Random parameters ``{"params": {...}}`` (normal(0.02) matrices, HF-default norms)."""
    return init_params(CausalLM(cfg), rng)


def apply(
    params: Any,
    tokens: jax.Array,
    cfg: DecoderConfig,
    *,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
) -> jax.Array:
    """Logits ``[B, T, vocab]`` for int ``tokens [B, T]``. Pure; jit with ``cfg`` static.

    ``attention_mask`` (1 = real token) masks padded keys; ``positions`` default to 0..T-1.
    """
    return lm_logits(CausalLM(cfg), params, tokens, positions, attention_mask)


def naming(cfg: DecoderConfig) -> Naming:
    """The preset ``Naming`` matching ``init(rng, cfg)``'s pytree."""
    return preset(cfg.family, **cfg.preset_kwargs())


def family_config(family: str) -> Callable[..., DecoderConfig]:
    """A family module's ``config(**overrides)``: a tiny-by-default config of ``family``;
    keywords override any field."""

    def config(**overrides: Any) -> DecoderConfig:
        return DecoderConfig.for_family(family, **overrides)

    config.__doc__ = f"A tiny-by-default {family} config; keywords override any field."
    return config
