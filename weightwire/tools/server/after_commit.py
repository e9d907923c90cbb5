"""What the round's first and last calls may also do, asked in the same request.

``/start_weight_update?pause=<mode>`` (advertised as ``START_PAUSES``) first does what
``/pause?mode=`` does, once the start's own checks passed (a refused start pauses nothing);
then the start. The trainer treats such a start, whatever it answered, as a pause held
(its resume rules then apply as after a failed start).


A colocated round's control calls are most of its fixed cost: after the commit a trainer
drops the caches and resumes generation, three more requests one after another. This
server advertises ``FINISH_RESETS_RESUMES`` in its init reply; a client that saw it may ask
``/finish_weight_update?reset_caches=true&resume=true`` instead. Only after a commit: a
finish that failed (or closed an empty round) reset and resumed nothing, so the trainer's
own rule for a failed round applies, as with separate calls.

- ``reset_caches``: this server keeps no KV or encoder output beyond one request (a request
  runs under the model lock a commit takes), so there is nothing to drop: as its
  ``/reset_prefix_cache`` and ``/reset_encoder_cache`` routes, it answers success.
- ``resume``: lifts the round's pause (``/resume``'s hold) once it committed. While
  ``/sleep`` holds the server too, generation stays held by the sleep's own hold until
  ``/wake_up`` (the reply's ``held_by_sleep`` says so); the ``/resume`` route itself
  refuses then, telling an operator that it would not wake the server.

Without ``resume`` (a round that stages asks for none), a commit still lifts a pause an
earlier round's start took and left held when that round failed (``lift_left_pause``): the
whole round that follows is what its trainer's rule waits for.

The reply adds ``caches_reset`` and ``resumed`` (booleans); an older server's refused
resume came back as ``resume_error``, which the client raises after the commit.

``UPDATE_FINISHES`` (advertised in the init reply too): ``/update_weights?finish=true``
(with the finish's ``reset_caches`` / ``resume`` flags and its ``weight_version`` in the
body beside ``update_info``) commits the round right after its update succeeded, answering
once: a round is two requests, its start and its update. A failed update commits nothing
(as always); a failed commit fails as a failed finish does (its error names
``finish_weight_update``); after the commit, what the flags ask, as above.

``UPDATE_STARTS`` (advertised too): ``/update_weights?start=true&pause=<mode>&finish=true``
is the round in one request, for a trainer whose data path writes nothing before the
workers' own word from inside their start or update (``weightwire_ipc`` written through):
the start's checks and the update's body checks first (a refusal pauses and starts
nothing), then the start's own pause and its workers' start, the update, the commit and the
finish's flags. ``start`` needs ``finish``: a start and an update that leave the round open
would only move the trainer's third call.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from weightwire.shared.routes import PAUSE_MODES, WAIT_BOUND
from weightwire.tools.server.state import ServerState
from weightwire.tools.server.web import ApiError, query_once

log = logging.getLogger(__name__)

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class AfterCommit:
    reset_caches: bool = False
    resume: bool = False


def after_commit_query(request: Request) -> AfterCommit:
    """The finish's ``reset_caches`` / ``resume`` query flags (422 naming a bad one)."""
    flags = {}
    for name in ("reset_caches", "resume"):
        raw = query_once(request, name)
        if raw is None or raw.lower() in _FALSE:
            flags[name] = False
        elif raw.lower() in _TRUE:
            flags[name] = True
        else:
            raise ApiError(
                422, f"query parameter {name} must be true or false, got {raw!r:.40}", param=name
            )
    return AfterCommit(**flags)


def after_commit(state: ServerState, then: AfterCommit) -> dict[str, Any]:
    """Do what ``then`` asks once the round committed; the reply's added fields. A pause an
    earlier round's start took and left held is lifted too (``lift_left_pause``)."""
    out: dict[str, Any] = {}
    if then.reset_caches:
        out["caches_reset"] = True  # nothing outlives a request here (module docstring)
    if not then.resume:
        lift_left_pause(state)
    else:
        # The round's own pause is lifted once it committed, asleep or not: the sleep holds
        # generation with a hold of its own (``PauseGate``), which /wake_up lifts. (Was:
        # refused while asleep, so the committed round raised and its pause outlived the
        # /wake_up that its error said would resume generation.)
        state.gate.resume()
        out["resumed"] = True
        if state.sleep.level is not None:
            out["held_by_sleep"] = (
                f"the server is asleep (/sleep level {state.sleep.level}): generation stays "
                "held until POST /wake_up"
            )
    return out


def lift_left_pause(state: ServerState) -> None:
    """After a commit: where the pause held is the one an earlier round's start took (no
    pause or resume since: ``PauseGate.round_pause``), that round failed with it held (its
    trainer's rule for a round that may have written in place) and this one committed, so
    the hold goes. A round that stages asks no pause and no resume, and would otherwise
    leave the server refusing every request after a whole round (was: until an operator's
    ``/resume``). A replica whose model still holds part of a round refuses generation
    with its own reason all the same."""
    gate, session = state.gate, state.session
    held = gate.round_pause
    if gate.mode is None or held is None or held[0] != gate.pauses or held[1] == session.round_id:
        return
    mode = gate.mode
    gate.resume()
    log.info(
        "round %d committed: lifted the pause (mode=%s) that round %d's start took and left "
        "held when it failed",
        session.round_id,
        mode,
        held[1],
    )


def pause_query(request: Request) -> str | None:
    """A start's ``pause`` mode (None: no pause asked; 422 naming a bad one)."""
    mode = query_once(request, "pause")
    if mode is not None and mode not in PAUSE_MODES:
        raise ApiError(
            422, f"pause must be one of {list(PAUSE_MODES)}, got {mode!r:.40}", param="pause"
        )
    return mode


def wait_bound_query(request: Request, mode: str | None, key: str) -> float | None:
    """A pause's ``wait_s`` (``PAUSE_BOUNDS``: the longest its client waits; None: not
    given); 422 naming it when it is not a positive number, or given to a pause that does not
    wait (``mode``, the value of query field ``key``, is not ``wait``)."""
    raw = query_once(request, WAIT_BOUND)
    if raw is None:
        return None
    if mode != "wait":
        raise ApiError(
            422,
            f"query parameter {WAIT_BOUND} bounds a pause that waits: give it with {key}=wait "
            f"(got {key}={mode!r:.20})",
            param=WAIT_BOUND,
        )
    try:
        bound = float(raw)
    except ValueError:
        bound = math.nan
    if not (math.isfinite(bound) and bound > 0):
        raise ApiError(
            422,
            f"{WAIT_BOUND} must be a positive number of seconds, got {raw!r:.40}",
            param=WAIT_BOUND,
        )
    return bound


@dataclass(frozen=True)
class StartAsked:
    """An update's ``start=true``: the round's start (and its ``pause``, its ``wait_s``) in
    the same request."""

    pause: str | None = None
    wait_s: float | None = None


def update_start_query(request: Request, then: AfterCommit | None) -> StartAsked | None:
    """An update's ``start`` flag and, with it, the start's ``pause`` (None: the round was
    started apart; 422 naming a bad flag, one given twice, a start without ``finish=true``,
    or a ``pause`` without ``start``)."""
    raw = query_once(request, "start")
    if raw is None or raw.lower() in _FALSE:
        for name in ("pause", WAIT_BOUND):
            if name in request.query_params:
                raise ApiError(
                    422, f"query parameter {name} is a start's: give start=true with it", param=name
                )
        return None
    if raw.lower() not in _TRUE:
        raise ApiError(
            422, f"query parameter start must be true or false, got {raw!r:.40}", param="start"
        )
    if then is None:
        raise ApiError(
            422,
            "start=true needs finish=true: the round in one request is its start, its update "
            "and its commit (start the round apart with /start_weight_update otherwise)",
            param="start",
        )
    mode = pause_query(request)
    return StartAsked(mode, wait_bound_query(request, mode, "pause"))


def update_finish_query(request: Request) -> AfterCommit | None:
    """An update's ``finish`` flag and, with it, the finish's ``reset_caches`` / ``resume``
    (None: a plain update; 422 naming a bad flag, or a finish's flag without ``finish``)."""
    raw = query_once(request, "finish")
    if raw is None or raw.lower() in _FALSE:
        for name in ("reset_caches", "resume"):
            if name in request.query_params:
                raise ApiError(
                    422,
                    f"query parameter {name} is a finish's: give finish=true with it",
                    param=name,
                )
        return None
    if raw.lower() not in _TRUE:
        raise ApiError(
            422, f"query parameter finish must be true or false, got {raw!r:.40}", param="finish"
        )
    return after_commit_query(request)
