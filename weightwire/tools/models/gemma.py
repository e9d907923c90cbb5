"""Flax Gemma (v1): norms computing ``x * (1 + w)`` in float32, embeddings scaled by
sqrt(hidden_size), gelu-tanh MLP, tied embeddings, as HF ``GemmaForCausalLM``.

Same API as ``llama``: ``config(**kw)`` / ``DecoderConfig.from_hf_config(d)``, ``init``,
``apply``, ``naming``.
"""

from __future__ import annotations

from weightwire.tools.models.decoder import DecoderConfig, apply, family_config, init, naming

FAMILY = "gemma"
config = family_config(FAMILY)


__all__ = ["FAMILY", "DecoderConfig", "apply", "config", "init", "naming"]
