"""After a committed round, nothing a server serves may come from the previous weights.

vLLM keeps KV blocks of finished requests for reuse (prefix caching, on by default on
GPU) and the encoder outputs of multimodal inputs; both were computed with the weights
live when they were made, and no weight route drops them (0.30-0.33:
``finish_weight_update`` only loads). So after every committed round, rank 0 resets them
before anything can be scheduled on the new weights:

    [pause] start update finish reset_prefix_cache reset_encoder_cache [resume]

- The reset asks vLLM to preempt running requests too (``reset_running_requests``), so a
  request frozen across the round (``pause`` ``keep``) or running when it landed
  recomputes its KV with the new weights instead of continuing on the old KV; and to reset
  a KV connector's external cache (``reset_external``).
- A round not paused as a whole (the plugin backends stage a round and apply it at
  finish, so ``pause_mode="auto"`` does not pause them) is reset right after its finish,
  unpaused: a pause held across the commit would leave vLLM paused, its requests queued
  with nobody to resume them, if the trainer died inside it, which is worse than the
  window it closes. The reset preempts every request still running, so only a request
  that both starts and ends within that one round trip can have used the old KV.
  ``pause_mode="keep"`` closes the window at that price.
- ``TrainerInitInfo(reset_prefix_cache=False)`` turns all of this off, for users who
  knowingly accept stale prefixes.

A reset that fails after the commit raises ``StaleCacheError``: the round is committed
(the engine stays usable), and the message says what may be served stale and how to
clear it. Never silent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightwire.shared.errors import WeightSyncError, WeightwireError
from weightwire.trainer.config import TrainerInitInfo

logger = logging.getLogger(__name__)

_RESET_ATTEMPTS = 3
_RESET_RETRY_S = 0.1
"""vLLM answers ``success: false`` while a KV connector still holds blocks (an async
offload in flight): worth a short retry; the server is paused meanwhile when it can be."""


class StaleCacheError(WeightwireError, RuntimeError):
    """The round was committed, but a server's caches could not be reset after it."""

    committed = True

    def __init__(self, weight_version: str, detail: str) -> None:
        super().__init__(
            f"round {weight_version!r} was committed (finish_weight_update returned), but the "
            f"servers' caches were not reset: {detail}. Requests whose prefix was cached before "
            "the round may be answered from KV computed with the previous weights until a reset "
            "succeeds (the next round's, or POST /reset_prefix_cache?reset_running_requests=true); "
            "TrainerInitInfo(reset_prefix_cache=False) accepts stale prefixes knowingly"
        )
        self.weight_version = weight_version
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.weight_version, self.detail))


@dataclass
class CommitPlan:
    """What rank 0 does around ``finish_weight_update`` (resolved once, at ``trainer_init``)."""

    reset: bool = True
    """Reset the servers' caches after every commit (``TrainerInitInfo.reset_prefix_cache``)."""

    def commit(self, client: Any, version: str, *, record: Callable[[], None]) -> None:
        """``finish_weight_update(version)``, ``record()`` as soon as it returned, then the reset
        (inside the round's pause when it has one: the caller resumes after this returns).

        Raises ``StaleCacheError`` when the commit held but the reset did not."""
        client.finish_weight_update(version)
        record()
        if self.reset:
            reset_after_commit(client, version)


def commit_plan(info: TrainerInitInfo, client: object, round_pause: str | None) -> CommitPlan:
    """The plan for this engine; ``round_pause`` is the mode the whole round is
    paused in (or None)."""
    if not info.reset_prefix_cache:
        logger.info(
            "reset_prefix_cache=False: vLLM may answer requests from KV computed before a round"
        )
        return CommitPlan(reset=False)
    if round_pause is not None:
        return CommitPlan(reset=True)
    can_pause = all(callable(getattr(client, m, None)) for m in ("pause", "resume"))
    if info.pause_mode == "auto" and can_pause:
        return CommitPlan(
            reset=True
        )  # a staging plugin backend: unpaused by design (the module docstring)
    why = (
        "pause_mode=None"
        if info.pause_mode is None
        else f"client {type(client).__name__} cannot pause"
    )
    logger.warning(
        "%s: the cache reset after each round runs unpaused; a request scheduled between the "
        "commit and the reset may reuse KV computed with the previous weights",
        why,
    )
    return CommitPlan(reset=True)


def reset_after_commit(client: Any, version: str) -> None:
    """Every server's prefix cache (running requests preempted) and encoder cache, dropped.

    ``client.reset_prefix_cache()`` returns one ``success`` per server (or nothing: a
    client that raised nothing is taken at its word); ``reset_encoder_cache`` is called
    when the client has it."""
    for attempt in range(1, _RESET_ATTEMPTS + 1):
        try:
            answers = client.reset_prefix_cache()
        except WeightSyncError as exc:
            hint = (
                (
                    " (the server has no /reset_prefix_cache route; vLLM serves it with "
                    "VLLM_SERVER_DEV_MODE=1, as it does the weight routes)"
                )
                if exc.status == 404
                else ""
            )
            raise StaleCacheError(version, f"{exc}{hint}") from exc
        except Exception as exc:
            raise StaleCacheError(
                version, f"reset_prefix_cache raised {type(exc).__name__}: {exc}"
            ) from exc
        refused = [] if answers is None else [i for i, ok in enumerate(answers) if ok is not True]
        if not refused:
            break
        if attempt == _RESET_ATTEMPTS:
            raise StaleCacheError(
                version,
                f"server(s) {', '.join(map(str, refused))} answered success=false to "
                f"/reset_prefix_cache {_RESET_ATTEMPTS} times (KV still held, e.g. by "
                "a KV connector's transfer in flight)",
            )
        time.sleep(_RESET_RETRY_S * attempt)
    encoder = getattr(client, "reset_encoder_cache", None)
    if callable(encoder):
        try:
            encoder()
        except Exception as exc:
            raise StaleCacheError(
                version,
                f"reset_encoder_cache failed ({exc}): a multimodal model's cached "
                "encoder outputs may come from the previous weights",
            ) from exc
