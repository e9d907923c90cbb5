"""Flax Qwen2: Llama plus biases on q/k/v (not o), as HF ``Qwen2ForCausalLM``.

Same API as ``llama``: ``config(**kw)`` / ``DecoderConfig.from_hf_config(d)``, ``init``,
``apply``, ``naming``.
"""

from __future__ import annotations

from typing import Any

from weightwire.tools.models.decoder import DecoderConfig, apply, init, naming

FAMILY = "qwen2"


def config(**overrides: Any) -> DecoderConfig:
    """A tiny-by-default config of this family; keywords override any field."""
    return DecoderConfig.for_family(FAMILY, **overrides)


__all__ = ["FAMILY", "DecoderConfig", "apply", "config", "init", "naming"]
