"""Flax (Linen) GPT-2, numerically the same architecture as HF ``GPT2LMHeadModel``.

HF GPT-2 stores its projections as ``Conv1D`` with weight ``[in, out]``: the same layout
as a Flax ``Dense`` kernel, so the preset maps them without a transpose (transposing the
square ``c_proj`` would still load, and silently compute garbage). ``separate_qkv=True``
keeps q/k/v as three Dense layers that the preset fuses into HF's ``c_attn``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from weightwire.jax_side.naming import Naming
from weightwire.jax_side.presets import preset
from weightwire.shared.errors import ConfigError
from weightwire.tools.models.common import (
    attend,
    attention_bias,
    dense,
    embed,
    init_params,
    lm_logits,
    positions_for,
)

_ACT = {
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
}


@dataclass(frozen=True, kw_only=True)
class GPT2Config:
    vocab_size: int = 128
    n_positions: int = 64
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    tie_word_embeddings: bool = True
    separate_qkv: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.activation_function not in _ACT:
            raise ConfigError(
                f"unsupported activation_function {self.activation_function!r}; "
                f"supported: {list(_ACT)}"
            )

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides: Any) -> GPT2Config:
        names = (
            "vocab_size",
            "n_positions",
            "n_embd",
            "n_layer",
            "n_head",
            "n_inner",
            "layer_norm_epsilon",
            "activation_function",
            "tie_word_embeddings",
        )
        return cls(**{**{k: hf[k] for k in names if k in hf}, **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("separate_qkv", "dtype", "param_dtype"):
            out.pop(k)
        return {"model_type": "gpt2", **out}

    def preset_kwargs(self) -> dict[str, Any]:
        return {"tie_word_embeddings": self.tie_word_embeddings, "separate_qkv": self.separate_qkv}

    @property
    def inner(self) -> int:
        return self.n_inner or 4 * self.n_embd


def _dense(cfg: GPT2Config, n: int, name: str, bias: bool = True) -> nn.Dense:
    return dense(n, name=name, bias=bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype)


def _ln(cfg: GPT2Config, name: str) -> nn.LayerNorm:
    # Two-pass variance, as torch computes it (the default one-pass form differs in the last bits).
    return nn.LayerNorm(
        cfg.layer_norm_epsilon,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        use_fast_variance=False,
        name=name,
    )


class Block(nn.Module):
    cfg: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.cfg
        x = x + _Attn(c, name="attn")(_ln(c, "ln_1")(x), bias)
        return x + _MLP(c, name="mlp")(_ln(c, "ln_2")(x))


class _Attn(nn.Module):
    cfg: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.cfg
        b, t, e = x.shape
        if c.separate_qkv:
            q, k, v = (_dense(c, e, f"{p}_proj")(x) for p in "qkv")
        else:
            q, k, v = jnp.split(_dense(c, 3 * e, "c_attn")(x), 3, axis=-1)
        d = e // c.n_head
        q, k, v = (y.reshape(b, t, c.n_head, d) for y in (q, k, v))
        return _dense(c, e, "c_proj")(attend(q, k, v, bias, d**-0.5))


class _MLP(nn.Module):
    cfg: GPT2Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        return _dense(c, c.n_embd, "c_proj")(
            _ACT[c.activation_function](_dense(c, c.inner, "c_fc")(x))
        )


class Transformer(nn.Module):
    cfg: GPT2Config

    def setup(self) -> None:
        c = self.cfg
        self.wte = embed(c.vocab_size, c.n_embd, dtype=c.dtype, param_dtype=c.param_dtype)
        self.wpe = embed(c.n_positions, c.n_embd, dtype=c.dtype, param_dtype=c.param_dtype)
        self.h = [Block(c) for _ in range(c.n_layer)]
        self.ln_f = _ln(c, "ln_f")

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None, attention_mask: jax.Array | None
    ) -> jax.Array:
        x = self.wte(tokens) + self.wpe(positions_for(tokens, positions))
        bias = attention_bias(tokens, attention_mask, x.dtype)
        for block in self.h:
            x = block(x, bias)
        return self.ln_f(x)

    def attend(self, h: jax.Array) -> jax.Array:
        return self.wte.attend(h)


class GPT2LMHead(nn.Module):
    cfg: GPT2Config

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
    ) -> jax.Array:
        tr = Transformer(self.cfg, name="transformer")
        h = tr(tokens, positions, attention_mask)
        if self.cfg.tie_word_embeddings:
            return tr.attend(h)
        return _dense(self.cfg, self.cfg.vocab_size, "lm_head", bias=False)(h)


def config(**overrides: Any) -> GPT2Config:
    return GPT2Config(**overrides)


def init(rng: jax.Array, cfg: GPT2Config) -> dict[str, Any]:
    """Random parameters ``{"params": {...}}``."""
    return init_params(GPT2LMHead(cfg), rng)


def apply(
    params: Any,
    tokens: jax.Array,
    cfg: GPT2Config,
    *,
    positions: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
) -> jax.Array:
    """Logits ``[B, T, vocab]``. Pure; jit with ``cfg`` static."""
    return lm_logits(GPT2LMHead(cfg), params, tokens, positions, attention_mask)


def naming(cfg: GPT2Config) -> Naming:
    return preset("gpt2", **cfg.preset_kwargs())
