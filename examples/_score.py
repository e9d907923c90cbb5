"""Shared check of the decoder examples: does the server compute what the JAX model does?

``logprob_gap`` asks the server for its greedy completion of a prompt (token ids and
log-probabilities over ``/v1/completions``), scores the same tokens with the JAX model,
and returns the largest difference: ~1e-6 when the round landed, far more when a tensor
went to the wrong place or a stale layer stayed.
"""

from __future__ import annotations

from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np

from weightwire.tools.models import decoder


def token_logprobs(params: Any, seqs: jax.Array, cfg: decoder.DecoderConfig) -> jax.Array:
    """``[B, T-1]``: log p(seqs[:, t+1] | seqs[:, :t+1]) under the JAX model, in float32."""
    logits = decoder.apply(params, seqs[:, :-1], cfg).astype(jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), seqs[:, 1:, None], axis=-1)[
        ..., 0
    ]


def logprob_gap(
    url: str, params: Any, cfg: decoder.DecoderConfig, prompt: np.ndarray, max_tokens: int = 8
) -> float:
    """max |server log p - JAX log p| over the server's greedy completion of ``prompt``."""
    reply = httpx.post(
        f"{url.rstrip('/')}/v1/completions",
        timeout=120,
        json={
            "prompt": prompt.tolist(),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    sequence = jnp.asarray([[*prompt.tolist(), *choice["token_ids"]]], jnp.int32)
    served = np.asarray([choice["logprobs"]["token_logprobs"]], np.float32)
    mine = np.asarray(token_logprobs(params, sequence, cfg))[:, len(prompt) - 1 :]
    return float(np.max(np.abs(mine - served)))
