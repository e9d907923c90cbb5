"""Which server features a trainer engine may use: the server's word, the user's, or both.

``TrainerInitInfo.server_version`` is for clients that cannot ask (``version()``
missing); when the client *can* ask, a stated version that names a different release
than the server reports is refused: gating a 0.32 server as 0.33 makes an unchanged
round load 0 tensors and leave stray bytes on the wire. ``version_override`` is the
explicit escape hatch ("treat this server as release X"); it is logged on every init.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightwire.shared.client import ROUND_CALLS, EngineClient, ServerControls
from weightwire.shared.errors import ConfigError, WrongType
from weightwire.shared.routes import start_left_paused
from weightwire.shared.staging import round_streams
from weightwire.shared.version import ServerFeatures, parse_version, resolve_release
from weightwire.trainer.caps import ClientCaps
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.early import one_server
from weightwire.trainer.transfer import best_effort_resume
from weightwire.vllm_guard import MIDDLEWARE

logger = logging.getLogger(__name__)


def server_features(
    info: TrainerInitInfo, client: ServerControls, caps: ClientCaps
) -> ServerFeatures:
    """The ``ServerFeatures`` for this engine (``ValueError`` naming what disagrees)."""
    stated = info.server_version
    asked = None
    if caps.version:
        try:
            asked = client.version()
        except Exception:
            if stated is None:
                raise
            # The client cannot tell (e.g. a Ray client built without one): the
            # stated version stands.
            logger.info(
                "client %s cannot report the server version; using server_version=%s",
                type(client).__name__,
                stated,
            )
    if stated is not None and asked is not None:
        got, want = (
            resolve_release(parse_version(asked))[0],
            resolve_release(parse_version(stated))[0],
        )
        if got != want:
            raise ConfigError(
                f"TrainerInitInfo.server_version is {stated!r} but the server reports {asked!r}; "
                "drop server_version, or set version_override to gate on purpose"
            )
    version = asked if asked is not None else stated
    if version is None:
        raise ConfigError(
            "no server version: the client has no version() and "
            "TrainerInitInfo.server_version is unset"
        )
    features = ServerFeatures.for_version(version, override=info.version_override)
    if info.version_override is not None:
        logger.warning("server version %s gated by override as %s", version, info.version_override)
    return features


def require_draft_model(client: EngineClient, caps: ClientCaps) -> None:
    """Refuse a draft round unless every server confirms a speculative draft model.

    A stock vLLM (seen on 0.32) asked to start a draft update without one raises in
    its worker, and that kills the engine core: the server is gone, not just the round.
    So the answer must be a confirmed yes (``client.has_draft_model()``), never a guess.
    """
    if not caps.has_draft_model:
        raise WrongType(
            f"client {type(client).__name__} cannot confirm a speculative draft model (no "
            "has_draft_model()); a draft round on a server without one kills vLLM's engine"
        )
    answers = list(client.has_draft_model())
    missing = [i for i, ok in enumerate(answers) if not ok]
    if not answers or missing:
        which = ", ".join(str(i) for i in missing) or "all"
        raise ConfigError(
            f"server(s) {which} show no speculative draft model (/server_info has no "
            "speculative_config); a draft round there would kill vLLM's engine core. "
            "Nothing was sent"
        )


def check_client(
    info: TrainerInitInfo, client: object, caps: ClientCaps, *, stock_receiver: bool
) -> str | None:
    """The round's pause mode (``None``: no pause), after refusing a client that lacks a
    call this engine will make (``WrongType`` naming every missing one, before any rendezvous).

    ``pause_mode="auto"`` resolves here for the session: only a stock worker loads into the
    running model mid-round (layerwise reload puts layers on the meta device: a request
    scheduled then crashes vLLM). The plugin workers stage a round within the stage budget
    and apply it in one call at finish, so such a round needs no pause (and a trainer that
    dies mid-round cannot leave the server paused); a round over the budget is paused per
    round by ``round_pause``.
    """
    needed = list(ROUND_CALLS)
    pause_mode = None if info.pause_mode == "auto" else info.pause_mode
    if info.pause_mode == "auto":
        pause_mode = "keep" if caps.can_pause and stock_receiver else None
        if stock_receiver and not caps.can_pause:
            logger.warning(
                "client %s cannot pause generation: rounds run under live traffic "
                "(vLLM crashes when a request meets a layer mid-reload)",
                type(client).__name__,
            )
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
    missing = caps.lacks(needed)
    if missing:
        raise WrongType(
            f"client {type(client).__name__} lacks {', '.join(missing)} (give server_version / "
            "inference_world_size in TrainerInitInfo, or drop verify / pause_mode; without "
            "reset_prefix_cache vLLM may serve KV of the previous weights after a round: "
            "reset_prefix_cache=False accepts that)"
        )
    return pause_mode


@dataclass(frozen=True)
class RoundPause:
    """How one round pauses generation: ``mode`` (``None``: not at all), and whether a
    failed round resumes (a round applied in place never does: the servers keep refusing
    rather than serve a half-updated model)."""

    mode: str | None
    resume_on_failure: bool = True
    guard: bool = False
    """Every server has the round guard (``weightwire.vllm_guard``): held from before the
    round's first write until its commit, so requests are refused with the reason."""


def round_pause(
    info: TrainerInitInfo,
    session_mode: str | None,
    *,
    stock_receiver: bool,
    nbytes: int,
    client: object,
    caps: ClientCaps,
    guard: Callable[[], bool] | None = None,
    in_place: bool = False,
) -> RoundPause:
    """The pause of a round of ``nbytes`` (``session_mode``: ``check_client``'s answer).
    ``guard``: whether the servers run the round guard (default: ask them now).

    A plugin worker applies a round over ``stage_budget_bytes`` in place
    (``shared.staging.round_streams``, the rule the worker applies too): from its first
    write until a complete round commits, generation must be refused. ``auto`` (and
    ``keep``, which would queue requests behind a failed round) pause with ``abort``:
    vLLM >= 0.33 then answers new requests 503 ``engine_paused`` until ``/resume``; the
    resume comes only after the commit. ``pause_mode=None`` is the user's explicit opt-out.
    ``in_place``: the session writes every round in place (``weightwire_ipc``
    write-through), whatever its size.
    """
    if stock_receiver or not (in_place or round_streams(nbytes, info.stage_budget_bytes)):
        return RoundPause(session_mode)
    why = (
        "written through"
        if in_place
        else f"{nbytes} bytes > stage_budget_bytes {info.stage_budget_bytes}"
    )
    return in_place_pause(
        info, caps, (lambda: guard_installed(client, caps)) if guard is None else guard, why
    )


def in_place_pause(
    info: TrainerInitInfo, caps: ClientCaps, guard: Callable[[], bool], why: str
) -> RoundPause:
    """The pause of a round the workers apply in place as it arrives (``why``: what makes it
    so): refusing new requests from before the first write until a complete round commits;
    a failed round is not resumed. ``guard``: whether the servers run the round guard."""
    if info.pause_mode is None:
        return RoundPause(None, resume_on_failure=False)
    if not caps.can_pause:
        logger.warning(
            "client cannot pause: a round applied in place (%s) runs under live traffic, "
            "and a failure would leave a half-updated model served",
            why,
        )
        return RoundPause(None, resume_on_failure=False)
    mode = "abort" if info.pause_mode in ("auto", "keep") else info.pause_mode
    if info.pause_mode == "keep":
        logger.warning(
            "pause_mode='keep' would queue requests behind a round applied in place that may fail; "
            "pausing this round with 'abort' (new requests refused until it commits)"
        )
    return RoundPause(mode, resume_on_failure=False, guard=guard())


def guard_installed(client: Any, caps: ClientCaps) -> bool:
    """Whether every server runs the round guard and it covers the server (one API-server
    process); otherwise a warning says what a failed round in place leaves and how to fix it."""
    states: list[Any] = []
    if caps.round_guard:
        try:
            states = list(client.round_guard())
        except Exception as exc:
            logger.warning("could not ask the servers for the round guard (%s)", exc)
    if states and all(isinstance(s, dict) and s.get("covers") is True for s in states):
        return True
    if reference_server(client):
        return False  # it refuses generation itself, with the reason, while its model is incomplete
    shared = [i for i, s in enumerate(states) if isinstance(s, dict) and not s.get("covers")]
    if not caps.round_guard:
        why = (
            f"client {type(client).__name__} cannot hold a round guard (an HTTP server's "
            f"--middleware {MIDDLEWARE})"
        )
    elif shared:
        why = (
            f"server(s) {shared} run several API-server processes, which the round guard "
            "cannot cover"
        )
    else:
        why = f"the servers do not run the round guard (start vLLM with --middleware {MIDDLEWARE})"
    logger.warning(
        "%s: if this round applied in place fails, generation stays paused with 'abort' "
        "until a complete round commits; vLLM >= 0.33 then answers 503 'Generation is "
        "paused' without the reason, vLLM <= 0.32 queues new requests until then "
        "(docs/reliability.md)",
        why,
    )
    return False


def reference_server(client: object) -> bool:
    """weightwire's own reference server (its version's local segment says so)."""
    try:
        local = parse_version(client.version()).local  # type: ignore[attr-defined]
    except Exception:
        return False
    return bool(local) and str(local).startswith("weightwire")


def hold_guard(client: Any, pause: RoundPause, version: str) -> bool:
    """Before the round's first write: the servers refuse requests that run the model.
    Returns whether the guard is held now."""
    if pause.guard:
        client.hold_round(version)
    return pause.guard


def release_guard(client: Any, pause: RoundPause) -> bool:
    """After the commit (and cache reset, and resume): the servers serve again. The guard
    checks the workers first; a refusal (a tensor of a broken round not rewritten) raises.
    Returns whether the guard is still held (False)."""
    if pause.guard:
        client.release_round(resume=False)
    return False


def after_failed_round(
    client: object, pause: RoundPause, *, refused_start: BaseException | None = None
) -> None:
    """A paused round failed: resume, unless the workers may hold part of it in place.
    ``refused_start``: the error of the round's start that carried its pause
    (``START_PAUSES``), whose refusal says what became of that pause in its error body's
    field (``WeightSyncError.pause``, read by ``routes.start_left_paused``: it paused
    nothing, or undid its pause; a pause held before it stays); only a client of one server
    reads it (another may have paused)."""
    if pause.resume_on_failure:
        best_effort_resume(client)
        return
    if pause.guard:
        # The guard asks the workers: a round that failed before its first write left them
        # whole, and generation resumes; otherwise it keeps refusing, with the reason.
        try:
            client.release_round(resume=True)  # type: ignore[attr-defined]
        except Exception as exc:
            logger.error(
                "a round applied in place failed and the servers refuse requests that run "
                "the model, saying why: %s. The next complete round lifts it (or POST "
                "/weightwire/round_guard/release once the workers' weights are whole; "
                "docs/reliability.md)",
                exc,
            )
        else:
            logger.warning(
                "a round applied in place failed, and the workers' weights are whole: "
                "the servers serve the previous weights again"
            )
        return
    said = None
    if refused_start is not None and one_server(client):
        said = start_left_paused(getattr(refused_start, "pause", None))
    if said is False:
        logger.warning(
            "a round applied in place failed at its start, which the server refused: it says "
            "the start paused nothing or undid its pause, so generation is not paused by this "
            "round and the previous weights are served"
        )
        return
    why = "because their models may hold part of it"
    if said is True:
        why = "(the server refused the start and says a pause held before it stays)"
    logger.error(
        "a round applied in place failed: the servers stay paused (mode=%s, new requests refused) "
        "%s; the next complete round resumes them "
        "(docs/reliability.md, 'Rounds over the stage budget': the operator's way out)",
        pause.mode,
        why,
    )
