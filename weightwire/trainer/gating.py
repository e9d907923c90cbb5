"""Which server features a trainer engine may use: the server's word, the user's, or both.

``TrainerInitInfo.server_version`` is for clients that cannot ask (``version()``
missing); when the client *can* ask, a stated version that names a different release
than the server reports is refused: gating a 0.32 server as 0.33 makes an unchanged
round load 0 tensors and leave stray bytes on the wire. ``version_override`` is the
explicit escape hatch ("treat this server as release X"); it is logged on every init.
"""

from __future__ import annotations

import logging

from weightwire.shared.client import ROUND_CALLS, ServerControls
from weightwire.shared.version import ServerFeatures, parse_version, resolve_release
from weightwire.trainer.config import TrainerInitInfo

logger = logging.getLogger(__name__)


def server_features(info: TrainerInitInfo, client: ServerControls) -> ServerFeatures:
    """The ``ServerFeatures`` for this engine (``ValueError`` naming what disagrees)."""
    stated = info.server_version
    asked = None
    if callable(getattr(client, "version", None)):
        try:
            asked = client.version()
        except Exception:
            if stated is None:
                raise
            # The client cannot tell (e.g. a Ray client built without one): the stated version stands.
            logger.info("client %s cannot report the server version; using server_version=%s",
                        type(client).__name__, stated)
    if stated is not None and asked is not None:
        got, want = resolve_release(parse_version(asked))[0], resolve_release(parse_version(stated))[0]
        if got != want:
            raise ValueError(f"TrainerInitInfo.server_version is {stated!r} but the server reports {asked!r}; "
                             "drop server_version, or set version_override to gate on purpose")
    version = asked if asked is not None else stated
    if version is None:
        raise ValueError("no server version: the client has no version() and TrainerInitInfo.server_version is unset")
    features = ServerFeatures.for_version(version, override=info.version_override)
    if info.version_override is not None:
        logger.warning("server version %s gated by override as %s", version, info.version_override)
    return features


def require_draft_model(client: object) -> None:
    """Refuse a draft round unless every server confirms a speculative draft model.

    A stock vLLM (seen on 0.32) asked to start a draft update without one raises in
    its worker, and that kills the engine core: the server is gone, not just the round.
    So the answer must be a confirmed yes (``client.has_draft_model()``), never a guess.
    """
    ask = getattr(client, "has_draft_model", None)
    if not callable(ask):
        raise TypeError(f"client {type(client).__name__} cannot confirm a speculative draft model (no "
                        "has_draft_model()); a draft round on a server without one kills vLLM's engine")
    answers = list(ask())
    missing = [i for i, ok in enumerate(answers) if not ok]
    if not answers or missing:
        which = ", ".join(str(i) for i in missing) or "all"
        raise ValueError(f"server(s) {which} show no speculative draft model (/server_info has no "
                         "speculative_config); a draft round there would kill vLLM's engine core. Nothing was sent")


def check_client(info: TrainerInitInfo, client: object, *, stock_receiver: bool) -> str | None:
    """The round's pause mode (``None``: no pause), after refusing a client that lacks a
    call this engine will make (``TypeError`` naming every missing one, before any rendezvous).

    ``pause_mode="auto"`` resolves here: only a stock worker loads into the running model
    mid-round (layerwise reload puts layers on the meta device: a request scheduled then
    crashes vLLM). The plugin workers stage a round and apply it in one call at finish,
    so they need no pause, and not pausing there means a trainer that dies mid-round
    cannot leave the server paused with nobody to resume it.
    """
    needed = list(ROUND_CALLS)
    pause_mode = None if info.pause_mode == "auto" else info.pause_mode
    if info.pause_mode == "auto":
        can_pause = all(callable(getattr(client, m, None)) for m in ("pause", "resume"))
        pause_mode = "keep" if can_pause and stock_receiver else None
        if stock_receiver and not can_pause:
            logger.warning("client %s cannot pause generation: rounds run under live traffic "
                           "(vLLM crashes when a request meets a layer mid-reload)", type(client).__name__)
    if info.verify:
        needed.append("weight_checker")
    if pause_mode is not None:
        needed += ["pause", "resume"]
    if info.server_version is None:
        needed.append("version")
    if info.inference_world_size is None:
        needed.append("get_world_size")
    if info.reset_prefix_cache:
        needed.append("reset_prefix_cache")
    missing = [m for m in needed if not callable(getattr(client, m, None))]
    if missing:
        raise TypeError(
            f"client {type(client).__name__} lacks {', '.join(missing)} (give server_version / "
            "inference_world_size in TrainerInitInfo, or drop verify / pause_mode; without reset_prefix_cache "
            "vLLM may serve KV of the previous weights after a round: reset_prefix_cache=False accepts that)"
        )
    return pause_mode
