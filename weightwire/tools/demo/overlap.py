"""``weightwire demo --overlap``: the step's round streams while the next step runs.

The first steps sync blocking (``send_weights()``: the step waits for the whole round), the
rest overlapped (``send_weights(wait=False)``): a step ends with a wait for the previous
round's handle and the call that hands over the next round, and that wait plus the call is
what the trainer stands still for (its *stall*), printed next to the blocking rounds' time.

What the overlap costs is staleness, and the checks account for it:

- round ``k`` lands while step ``k + 1`` samples its rollouts, so those come from the
  policy after step ``k`` or, not yet replaced, after step ``k - 1`` (at most one round
  behind: one round in flight). Each rollout token's server log-probability must equal the
  policy's under one of those two parameter sets (JAX arrays are immutable: the older set is
  kept by reference); the share served by the older one is reported;
- once round ``k``'s handle returned, before round ``k + 1`` is handed over, the server
  must report version ``k`` and its greedy completion of the fixed prompt must carry the
  log-probabilities of the policy after step ``k``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightwire.tools.demo.checks import Check, fixed_prompt_check


def blocking_steps(steps: int) -> int:
    """How many of ``--steps`` sync blocking first (the comparison), the rest overlapped."""
    return max(1, min(steps - 1, steps // 4 or 1))


@dataclass(frozen=True)
class Landed:
    """A round whose handle returned, as checked before the next one was handed over."""

    version: str
    served: str | None
    check: Check
    round_seconds: float
    """The round's own time (start to verified), what a blocking call would have waited."""
    wait_seconds: float
    nbytes: int


@dataclass(frozen=True)
class Handover:
    landed: Landed | None
    stall_seconds: float
    """Waiting for the previous round plus the ``send_weights(wait=False)`` call."""


@dataclass(frozen=True)
class RolloutCheck:
    diff: float
    """Max over tokens of the smaller |server - policy| of the two allowed parameter sets."""
    stale: float
    """Share of tokens only the older parameter set explains (sampled one round behind)."""


class OverlapSync:
    """The demo's overlapped rounds: at most one in flight, each checked once it landed."""

    def __init__(self, ctx: Any, cfg: Any, fixed: np.ndarray) -> None:
        self._ctx, self._cfg, self._fixed = ctx, cfg, fixed
        self._pending: tuple[Any, str, Any] | None = None  # (handle, version, params sent)
        self._landed_params: Any = ctx.policy.params  # what the server holds for sure

    def landed_blocking(self) -> None:
        """A blocking round just landed: the policy's current params are what is served."""
        self._landed_params = self._ctx.policy.params

    def rollouts(
        self, seqs: np.ndarray, prompt_len: int, server: np.ndarray, mine: np.ndarray
    ) -> RolloutCheck:
        """``mine``: the policy's log-probabilities under its params before this step's update
        (what the round in flight carries); the older set is the last landed round's."""
        now = np.abs(mine - server)
        if float(now.max()) < self._cfg.tolerance or self._pending is None:
            return RolloutCheck(float(now.max()), 0.0)
        older = self._ctx.policy.logprobs(seqs, self._landed_params)[:, prompt_len - 1 :]
        before = np.abs(older - server)
        best = np.minimum(now, before)
        stale = (now >= self._cfg.tolerance) & (before < self._cfg.tolerance)
        return RolloutCheck(float(best.max()), float(stale.mean()))

    def handover(self, version: str) -> Handover:
        """Wait for the round in flight, check it, then hand over ``version`` (this step's).
        The check runs between the two and is not part of the stall."""
        landed = self.land()
        start = time.perf_counter()
        handle = self._ctx.engine.send_weights(version, wait=False)
        called = time.perf_counter() - start
        self._pending = (handle, version, self._ctx.policy.params)
        return Handover(landed, called + (0.0 if landed is None else landed.wait_seconds))

    def land(self) -> Landed | None:
        """The round in flight, waited for and checked (``None`` when none is)."""
        if self._pending is None:
            return None
        handle, version, params = self._pending
        self._pending = None
        start = time.perf_counter()
        metrics = handle.result()
        waited = time.perf_counter() - start
        self._landed_params = params
        ctx, cfg = self._ctx, self._cfg
        served = ctx.client.weight_info()[0].get("weight_version")
        check = fixed_prompt_check(
            ctx.completions, ctx.policy, ctx.reward, self._fixed, cfg.check_tokens, params=params
        )
        return Landed(version, served, check, metrics.total_seconds, waited, metrics.nbytes)
