"""Flax Qwen2: Llama plus biases on q/k/v (not o), as HF ``Qwen2ForCausalLM``.

Same API as ``llama``: ``config(**kw)`` / ``DecoderConfig.from_hf_config(d)``, ``init``,
``apply``, ``naming``.
"""

from __future__ import annotations

from weightwire.tools.models.decoder import DecoderConfig, apply, family_config, init, naming

FAMILY = "qwen2"
config = family_config(FAMILY)


__all__ = ["FAMILY", "DecoderConfig", "apply", "config", "init", "naming"]
