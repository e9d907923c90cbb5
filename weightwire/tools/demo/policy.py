"""The demo's JAX policy: a Flax decoder trained by REINFORCE with a baseline, in Adam.

Adam comes from optax, which flax already depends on, so it adds no install.

The reward is a mean of per-token rewards (``reward.CharReward``), so each sampled
token gets its own advantage ``r_t - mean(r)`` (the batch mean is the baseline) and
is not credited with the tokens after it (discount 0). That estimator has far lower
variance than crediting a whole sequence with its total, which is what makes the
reward visibly rise within a handful of steps at batch 16.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from weightwire.shared.errors import ConfigError
from weightwire.tools.models import decoder


def token_logprobs(params: Any, seqs: jax.Array, cfg: decoder.DecoderConfig) -> jax.Array:
    """``[B, T-1]``: log p(seqs[:, t+1] | seqs[:, :t+1]) in float32."""
    logits = decoder.apply(params, seqs[:, :-1], cfg).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, seqs[:, 1:, None], axis=-1)[..., 0]


def _update(
    params: Any,
    opt_state: Any,
    seqs: jax.Array,
    advantages: jax.Array,
    *,
    prompt_len: int,
    cfg: decoder.DecoderConfig,
    opt: optax.GradientTransformation,
) -> tuple[Any, Any, jax.Array, jax.Array]:
    def loss_fn(p: Any) -> tuple[jax.Array, jax.Array]:
        lp = token_logprobs(p, seqs, cfg)[:, prompt_len - 1 :]
        return -jnp.mean(advantages * lp), lp

    (loss, lp), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, lp


class Policy:
    """Holds the live params; ``params`` is what ``PytreeSource(lambda: policy.params, ...)``
    reads."""

    def __init__(self, cfg: decoder.DecoderConfig, params: Any, *, lr: float) -> None:
        if not lr > 0:
            raise ConfigError(f"learning rate must be > 0, got {lr}")
        self.cfg = cfg
        self.params = params
        self._opt = optax.adam(lr)
        self._opt_state = self._opt.init(params)
        self._logprobs = jax.jit(partial(token_logprobs, cfg=cfg))
        self._update = jax.jit(
            partial(_update, cfg=cfg, opt=self._opt), static_argnames=("prompt_len",)
        )

    def warmup(self, seqs: np.ndarray, prompt_len: int) -> None:
        """Compile the step for ``seqs``' shape; the result is discarded (the step is pure)."""
        tokens = jnp.asarray(seqs, jnp.int32)
        advantages = jnp.zeros((tokens.shape[0], tokens.shape[1] - prompt_len), jnp.float32)
        jax.block_until_ready(
            self._update(self.params, self._opt_state, tokens, advantages, prompt_len=prompt_len)
        )

    def logprobs(self, seqs: np.ndarray, params: Any = None) -> np.ndarray:
        """Per-token log-probabilities of ``seqs[:, 1:]`` under ``params`` (default: the
        current ones; an earlier step's stay valid, JAX arrays being immutable)."""
        use = self.params if params is None else params
        return np.asarray(self._logprobs(use, jnp.asarray(seqs, jnp.int32)))

    def step(
        self, seqs: np.ndarray, prompt_len: int, token_rewards: np.ndarray
    ) -> tuple[float, np.ndarray]:
        """One policy-gradient step on completions ``seqs[:, prompt_len:]``.

        Returns ``(loss, logprobs)`` where ``logprobs [B, N]`` are the completion tokens'
        log-probabilities *before* the step (what the server sampled them with).
        """
        rewards = np.asarray(token_rewards, np.float32)
        advantages = rewards - rewards.mean()
        self.params, self._opt_state, loss, lp = self._update(
            self.params,
            self._opt_state,
            jnp.asarray(seqs, jnp.int32),
            jnp.asarray(advantages),
            prompt_len=prompt_len,
        )
        return float(loss), np.asarray(lp)
