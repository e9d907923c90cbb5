"""Flax Qwen3: Llama plus per-head RMSNorm on q and k before rotary, as HF ``Qwen3ForCausalLM``.

Same API as ``llama``: ``config(**kw)`` / ``DecoderConfig.from_hf_config(d)``, ``init``,
``apply``, ``naming``.
"""

from __future__ import annotations

from weightwire.tools.models.decoder import DecoderConfig, apply, family_config, init, naming

FAMILY = "qwen3"
config = family_config(FAMILY)


__all__ = ["FAMILY", "DecoderConfig", "apply", "config", "init", "naming"]
