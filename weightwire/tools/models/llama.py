"""Flax (Linen) Llama, numerically the same architecture as HF ``LlamaForCausalLM``
(RMSNorm, rotary with HF's rotate_half convention, grouped-query attention, SwiGLU).

Stable API (the demo and benchmarks build on it)::

    cfg = LlamaConfig.from_hf_config(hf_config_dict)   # or LlamaConfig(hidden_size=64, ...)
    params = init(jax.random.key(0), cfg)               # {"params": {...}}
    logits = apply(params, tokens, cfg)                 # jit with cfg static
    fn = make_apply(cfg); fn(params, tokens, attention_mask)  # bound and jitted
    naming(cfg)                                         # the matching weightwire Naming

``LlamaConfig(scan_layers=True)`` stores the layers as one stacked subtree; the preset
maps both layouts to the same HF names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from weightwire.jax_side.naming import Naming
from weightwire.tools.models import decoder
from weightwire.tools.models.decoder import DecoderConfig

LlamaConfig = DecoderConfig
"""The config dataclass (``family`` defaults to ``"llama"``); ``LlamaConfig.from_hf_config(d)``
reads an HF ``config.json`` dict, ``cfg.to_hf_config()`` writes one."""


def init(rng: jax.Array, cfg: DecoderConfig) -> dict[str, Any]:
    """Random parameters ``{"params": {...}}``."""
    return decoder.init(rng, cfg)


def apply(params: Any, tokens: jax.Array, cfg: DecoderConfig, **kw: Any) -> jax.Array:
    """Logits ``[B, T, vocab]``; keyword ``attention_mask`` / ``positions`` as in
    ``decoder.apply``."""
    return decoder.apply(params, tokens, cfg, **kw)


def naming(cfg: DecoderConfig) -> Naming:
    """The preset ``Naming`` matching ``init(rng, cfg)``'s pytree."""
    return decoder.naming(cfg)


def config(**overrides: Any) -> DecoderConfig:
    """A tiny-by-default Llama config; keywords override any field."""
    return DecoderConfig.for_family("llama", **overrides)


def make_apply(cfg: DecoderConfig) -> Callable[..., jax.Array]:
    """``apply`` with ``cfg`` bound and jitted: ``fn(params, tokens, attention_mask=None)``."""

    def fn(params: Any, tokens: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        return decoder.apply(params, tokens, cfg, attention_mask=attention_mask)

    return jax.jit(fn)
