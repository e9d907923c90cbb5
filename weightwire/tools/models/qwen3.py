"""Flax Qwen3: Llama plus per-head RMSNorm on q and k before rotary, as HF ``Qwen3ForCausalLM``.

Same API as ``llama``: ``config(**kw)`` / ``DecoderConfig.from_hf_config(d)``, ``init``,
``apply``, ``naming``.
"""

from __future__ import annotations

from typing import Any

from weightwire.tools.models.decoder import DecoderConfig, apply, init, naming

FAMILY = "qwen3"


def config(**overrides: Any) -> DecoderConfig:
    """A tiny-by-default config of this family; keywords override any field."""
    return DecoderConfig.for_family(FAMILY, **overrides)


__all__ = ["FAMILY", "DecoderConfig", "apply", "config", "init", "naming"]
