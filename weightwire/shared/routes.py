"""The HTTP route table of vLLM's weight-sync API (dev-mode routes, root path).

Client and reference server both read this table, so a path or body key can only be
wrong in one place. ``server_url`` is the one reading of a server's base URL (the client's
and the command line's).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from weightwire.shared.errors import ConfigError


@dataclass(frozen=True)
class Route:
    name: str
    method: str
    path: str
    body_key: str | None = None
    """Top-level JSON key wrapping the payload (``init_info``), if any."""
    weight_route: bool = True
    """Guarded by the reference server's ``--api-key``."""


INIT = Route("init_weight_transfer_engine", "POST", "/init_weight_transfer_engine", "init_info")
START = Route("start_weight_update", "POST", "/start_weight_update")
START_DRAFT = Route("start_draft_weight_update", "POST", "/start_draft_weight_update")
UPDATE = Route("update_weights", "POST", "/update_weights", "update_info")
FINISH = Route("finish_weight_update", "POST", "/finish_weight_update", "weight_version")
SHUTDOWN = Route("shutdown_weight_transfer_engine", "POST", "/shutdown_weight_transfer_engine")
UPDATE_VERSION = Route("update_weight_version", "POST", "/update_weight_version", "new_version")
WEIGHT_INFO = Route("weight_info", "GET", "/weight_info")
WEIGHT_CHECKER = Route("weight_checker", "POST", "/weight_checker", "action")
WORLD_SIZE = Route("get_world_size", "GET", "/get_world_size")
PAUSE = Route("pause", "POST", "/pause")
RESUME = Route("resume", "POST", "/resume")
IS_PAUSED = Route("is_paused", "GET", "/is_paused")
ABORT_REQUESTS = Route("abort_requests", "POST", "/abort_requests", "request_ids")
SERVER_INFO = Route("server_info", "GET", "/server_info")
VERSION = Route("version", "GET", "/version", weight_route=False)
HEALTH = Route("health", "GET", "/health", weight_route=False)
COMPLETIONS = Route("completions", "POST", "/v1/completions", weight_route=False)

COLLECTIVE_RPC = Route("collective_rpc", "POST", "/collective_rpc")
"""vLLM's dev route that calls a worker method on every worker (``SERVED_MODEL_METHOD``);
not in ``ROUTES``: the reference server has none (its init reply tells what it serves)."""

SERVED_MODEL_METHOD = "weightwire_served_model"
"""The worker method the weightwire vLLM plugin installs on vLLM's workers: each worker's
``ServedModel.to_dict()`` (``None`` without a weightwire engine or a local safetensors
checkpoint), asked through ``COLLECTIVE_RPC`` where an init reply tells nothing. Here, not in
``shared.served``, so the plugin that installs it stays free of numpy."""

ROUND_STATS_METHOD = "weightwire_round_stats"
"""The worker method the plugin installs beside ``SERVED_MODEL_METHOD``: each worker's latest
round as its weightwire engine counted it, ``{"rank", "session", "bytes_received", "updates",
"committed"}`` (``None`` before a round or without a weightwire engine); asked through
``COLLECTIVE_RPC`` (a worker that received only its slice of a round shows it here)."""

ROUTES: dict[str, Route] = {
    r.name: r
    for r in (
        INIT,
        START,
        START_DRAFT,
        UPDATE,
        FINISH,
        SHUTDOWN,
        UPDATE_VERSION,
        WEIGHT_INFO,
        WEIGHT_CHECKER,
        WORLD_SIZE,
        PAUSE,
        RESUME,
        IS_PAUSED,
        ABORT_REQUESTS,
        SERVER_INFO,
        VERSION,
        HEALTH,
        COMPLETIONS,
    )
}

PAUSE_MODES = ("abort", "wait", "keep")
CHECKER_ACTIONS = ("checksum", "reset", "compare")

START_PAUSES = "start_pauses"
"""A feature the reference server names in its init reply: its
``/start_weight_update?pause=<mode>`` does ``/pause?mode=`` first, in the one request."""

PAUSE_BOUNDS = "pause_bounds"
"""A feature the reference server names in its init reply: a pause that waits for the running
requests (``/pause?mode=wait``, a start's ``pause=wait``, the round in one request's,
``/sleep?mode=wait``) takes ``wait_s`` (``WAIT_BOUND``), the longest its client waits for the
answer: the drain stops at the smaller of it and the server's own bound (``--generate-timeout``),
answering 504 with the pause (or the sleep) it took undone, so one its client gave up on never
takes effect later. The trainer's client sets it from its own request timeout
(``control.client``). The reference server names it in its ``/version`` reply too, so a
client's pause or sleep before any init is bounded as well. Stock vLLM has none (its /pause
and /sleep take no such field): it is never sent there."""

WAIT_BOUND = "wait_s"
"""``PAUSE_BOUNDS``' query field: seconds, a positive number."""

START_PAUSED_NOTHING = "this start paused nothing"
START_UNDID_PAUSE = "the pause this start took was undone"
START_KEPT_HELD = "the pause held before it stays"
"""What the reference server's refusal of a start that carried a pause (``START_PAUSES``)
says to a person, at the end of its message: refused before its pause, or refused after it
and the pause undone; a pause held before the start is named beside either. The trainer
reads the error body's ``START_PAUSE_FIELD`` instead, never these words."""

START_PAUSE_FIELD = "pause"
"""The key, inside the error body's ``"error"`` object, of what a refused start that carried
a pause (``START_PAUSES``) left: ``START_PAUSE_WORDS``. A start that failed once its workers
started carries none: its pause stays."""

REFUSAL_FIELD = "refusal"
"""The key, inside the error body's ``"error"`` object, naming what a worker refused as a
word a trainer reads instead of the message (``errors.DELTA_BASE_MISMATCH``: the round's
patches were built on a round the worker does not hold, so the trainer resends it dense).
The reference server sets it; stock vLLM's error bodies carry only the message, whose words
the trainer reads there (``errors.is_delta_base_mismatch``)."""

START_PAUSE_NONE = "none"
START_PAUSE_UNDONE = "undone"
START_PAUSE_HELD = "held"
START_PAUSE_WORDS = (START_PAUSE_NONE, START_PAUSE_UNDONE, START_PAUSE_HELD)
"""``START_PAUSE_FIELD``'s values: the start paused nothing; it paused, and undid that pause;
a pause held before the start stays (whichever of the two the start did)."""


def start_left_paused(pause: str | None) -> bool | None:
    """Whether a refused start that carried a pause left the server paused, as its error
    body's ``START_PAUSE_FIELD`` says (``WeightSyncError.pause``); ``None``: it says nothing
    (absent, or a word this version does not know: then it may be paused)."""
    if pause == START_PAUSE_HELD:
        return True
    if pause in (START_PAUSE_NONE, START_PAUSE_UNDONE):
        return False
    return None


FINISH_RESETS_RESUMES = "finish_resets_resumes"
"""A feature the reference server names in its init reply (``features``): its
``/finish_weight_update?reset_caches=true&resume=true`` drops the caches and resumes
generation after a commit, in the one request (``finish_reply``). Stock vLLM has none:
its clients send ``/reset_prefix_cache``, ``/reset_encoder_cache`` and ``/resume`` apart."""

UPDATE_FINISHES = "update_finishes"
"""A feature the reference server names in its init reply: its
``/update_weights?finish=true[&reset_caches=true][&resume=true]`` (body: ``update_info`` and
the finish's ``weight_version``) commits the round right after its update succeeded, as
``/finish_weight_update`` with those flags would, in the one request. A failed update
commits nothing; a failed commit answers as a failed finish (its message names
``finish_weight_update``). Stock vLLM has none: its rounds keep the separate finish."""

UPDATE_STARTS = "update_starts"
"""A feature the reference server names in its init reply: its
``/update_weights?start=true[&pause=<mode>]&finish=true[&reset_caches=true][&resume=true]``
(body: ``update_info`` and the finish's ``weight_version``) is the whole round in one request:
what ``/start_weight_update?pause=<mode>`` does (its checks, its pause, the workers' start),
then the update, then the commit and what the finish's flags ask. Every check that can
refuse runs before the pause and before any worker starts; an error's message begins with
the step that failed (``start_weight_update``, ``update_weights`` or
``finish_weight_update``). Stock vLLM has none: its rounds keep their separate calls."""

SERVED_MODEL = "served_model"
"""A feature the reference server names in its init reply, and the reply's key that carries it:
the checkpoint tensors its model takes (``shared.served.ServedModel``), which the trainer checks
every round against before the first byte. Stock vLLM's init reply carries none."""

SESSION_HEADER = "X-Weightwire-Session"
"""Carries the ``session_id`` an init reply returned on the session's later weight calls;
the reference server refuses (409) a call whose session a newer init replaced."""

# vLLM's sleep mode (dev-mode routes): /sleep?level=0|1|2&mode=...,
# /wake_up?tags=weights&tags=kv_cache.
SLEEP = Route("sleep", "POST", "/sleep")
WAKE_UP = Route("wake_up", "POST", "/wake_up")
IS_SLEEPING = Route("is_sleeping", "GET", "/is_sleeping")
ROUTES.update({r.name: r for r in (SLEEP, WAKE_UP, IS_SLEEPING)})

# vLLM's cache routes (dev mode, like the weight routes, in 0.30-0.33): after a round, drop what
# the old weights computed.
# /reset_prefix_cache?reset_running_requests=true&reset_external=true -> {"success": bool}.
RESET_PREFIX_CACHE = Route("reset_prefix_cache", "POST", "/reset_prefix_cache")
RESET_ENCODER_CACHE = Route("reset_encoder_cache", "POST", "/reset_encoder_cache")
ROUTES.update({r.name: r for r in (RESET_PREFIX_CACHE, RESET_ENCODER_CACHE)})
SLEEP_LEVELS = (0, 1, 2)
WAKE_TAGS = ("weights", "kv_cache", "scheduling")


def server_url(value: object) -> str:
    """A server's base URL as given by a user, as the client sends to it: ``http(s)://host:port``;
    a bare ``host:port`` gets ``http://`` (what every server weightwire talks to speaks); a
    trailing ``/`` is dropped. ``ConfigError`` naming the value and the expected form for
    anything else (before any request is made)."""
    if not isinstance(value, str):
        raise ConfigError(
            f"a server URL must be a str such as http://127.0.0.1:8000, got "
            f"{type(value).__name__} {value!r:.80}"
        )
    text = value.strip()
    if "://" not in text:
        text = f"http://{text}"
    problem = None
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError as exc:  # an unbalanced IPv6 bracket, say
        problem = str(exc)
    else:
        if parts.scheme not in ("http", "https"):
            problem = f"the scheme must be http:// or https://, not {parts.scheme}://"
        elif not parts.hostname:
            problem = "it names no host"
        elif any(c.isspace() for c in text):
            problem = "it contains white space"
        elif parts.query or parts.fragment:
            problem = "a base URL has no ?query or #fragment"
        elif parts.path.rstrip("/").endswith("/v1"):
            # The OpenAI clients' base URL: the weight-sync routes are at the server's root.
            problem = (
                "it ends in /v1, the OpenAI API's prefix; the weight-sync routes are at the root"
            )
        else:
            try:
                parts.port  # noqa: B018 -- raises ValueError for a port not a number in range
            except ValueError:
                problem = "its port is not a number in [0, 65535]"
    if problem:
        raise ConfigError(
            f"{value!r:.200} is not a server URL ({problem}): give http://HOST:PORT, e.g. "
            "http://127.0.0.1:8000 (a bare HOST:PORT means http://)"
        )
    return text.rstrip("/")
