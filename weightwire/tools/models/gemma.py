"""Flax Gemma (v1): norms computing ``x * (1 + w)`` in float32, embeddings scaled by
sqrt(hidden_size), gelu-tanh MLP, tied embeddings, as HF ``GemmaForCausalLM``.

Same API as ``llama``: ``config(**kw)`` / ``DecoderConfig.from_hf_config(d)``, ``init``,
``apply``, ``naming``.
"""

from __future__ import annotations

from typing import Any

from weightwire.tools.models.decoder import DecoderConfig, apply, init, naming

FAMILY = "gemma"


def config(**overrides: Any) -> DecoderConfig:
    """A tiny-by-default config of this family; keywords override any field."""
    return DecoderConfig.for_family(FAMILY, **overrides)


__all__ = ["FAMILY", "DecoderConfig", "apply", "config", "init", "naming"]
