"""HF checkpoint directories into the reference decoder models (``decoder``), through the
family's preset and ``jax_side.checkpoint``'s loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from weightwire.jax_side.checkpoint import (
    CheckpointError,
    pytree_from_hf,
    read_hf_config,
    read_safetensors,
)
from weightwire.tools.models import decoder


def load_decoder(model_dir: str | Path, **overrides: Any) -> tuple[Any, Any]:
    """``(cfg, params)`` of a Llama-like HF directory, through the family's preset.

    ``overrides`` set JAX-side layout switches (``scan_layers=True``, ...); the loaded
    pytree follows them, the checkpoint stays the same.
    """
    hf = read_hf_config(model_dir)
    try:
        cfg = decoder.DecoderConfig.from_hf_config(hf, **overrides)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{model_dir}/config.json: {exc}") from None
    abstract = jax.eval_shape(lambda: decoder.init(jax.random.key(0), cfg))
    tensors = read_safetensors(model_dir)
    if cfg.tie_word_embeddings:
        # Tied checkpoints may still carry lm_head.weight (a copy of the embedding); the
        # tied pytree has no leaf for it.
        tensors.pop("lm_head.weight", None)
    params = pytree_from_hf(decoder.naming(cfg), abstract, tensors)
    return cfg, params
