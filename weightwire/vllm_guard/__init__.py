"""The round guard: vLLM refuses requests that run the model while a round applied in place is open.

Install it in vLLM's API server::

    vllm serve MODEL --weight-transfer-config '{"backend": "weightwire_tcp"}' \\
        --middleware weightwire.vllm_guard.RoundGuard

A round larger than the trainer's ``stage_budget_bytes`` is written into the served model
as its bytes land. From its first write until it commits the model is part new, part
old, and if the trainer dies (or a worker gives up) in between, it stays so. vLLM's own
``/pause`` cannot say that: 0.32 queues new requests under every pause mode (they hang
until someone resumes), 0.33's ``abort`` pause answers 503 "Generation is paused".

With the guard, the trainer holds it (``POST /weightwire/round_guard/hold``) before such a
round and releases it after the commit. While held, every request that runs the model
(completions, chat, responses, embeddings, scoring, the realtime websocket, ...) is
answered at once with HTTP 503 and a JSON error saying which round left the weights
incomplete, since when, and what lifts it, whether the request carries the API key or not
(without it, the answer does not name the round). Only requests known not to run the
model pass (weight transfer, pause, resume, cache resets, tokenize, health, metrics, the
models list, ...: ``PASSING_POSTS``, ``PASSING_GETS``); anything else, a route a later
vLLM adds included, is refused.

The guard's routes need the server's API key (``--api-key`` / ``VLLM_API_KEY``, read as
vLLM reads ``Authorization``). Without an API key anyone who can reach the server can
hold the guard (and refuse every request) or release it: give vLLM an API key when
clients you do not trust reach it.

The way out is bounded: the next trainer's complete round releases it, and an operator can
``POST /weightwire/round_guard/release``, which asks the workers first (the plugin's
``weightwire_round_state`` worker method, through vLLM's ``collective_rpc``, one call
per release, never per request) and answers 409 with their reason while their weights are
not whole, or while a worker's answer is to an earlier call (``OUT_OF_STEP``). A release
resumes generation too (``?resume=false`` keeps a pause).

The guard's state lives in the API-server process. With ``--api-server-count`` above 1
each process has its own, so the guard declines to hold (409) and reports
``covers: false``; the trainer then warns. This package is torch-free and imports no vLLM
at module level: it runs inside vLLM's API server and in the plugin's workers (``worker``:
the workers' answer; ``asgi``: the plumbing the middleware runs on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from weightwire.shared.routes import Route
from weightwire.vllm_guard.asgi import (
    ASGIApp,
    Receive,
    Reply,
    Scope,
    Send,
    api_server_count,
    authorized,
    engine_client,
    read_body,
    route_path,
    send_reply,
)
from weightwire.vllm_guard.worker import WORKER_METHOD

log = logging.getLogger(__name__)

MIDDLEWARE = "weightwire.vllm_guard.RoundGuard"
"""What ``--middleware`` takes."""
GUARD_API = 1
STATUS = Route("round_guard", "GET", "/weightwire/round_guard", weight_route=False)
HOLD = Route("hold_round", "POST", "/weightwire/round_guard/hold", weight_route=False)
RELEASE = Route("release_round", "POST", "/weightwire/round_guard/release", weight_route=False)
WORKER_TIMEOUT_S = 30.0
"""Bound on asking the workers at a release (a worker busy in a round answers after it)."""
_MAX_TEXT = 200

PASSING_POSTS = frozenset(
    {
        # weight transfer and its control
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/shutdown_weight_transfer_engine",
        "/update_weight_version",
        "/weight_checker",
        "/pause",
        "/resume",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/sleep",
        "/wake_up",
        "/abort_requests",
        "/collective_rpc",
        "/release_kv_cache_memory",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/fault_tolerance/apply",
        "/ping",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        # tokenization and rendering: no forward pass
        "/tokenize",
        "/detokenize",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/responses/render",
        "/v1/messages/render",
        "/v1/messages/count_tokens",
        "/v1/completions/derender",
        "/v1/chat/completions/derender",
    }
)
"""POST routes of vLLM 0.32/0.33 that never run the model."""

PASSING_GETS = frozenset(
    {
        # health, load and metrics
        "/health",
        "/ping",
        "/load",
        "/version",
        "/metrics",
        "/ready",
        "/readyz",
        # state the trainer and operators read
        "/v1/models",
        "/is_paused",
        "/is_sleeping",
        "/get_world_size",
        "/weight_info",
        "/server_info",
        "/tokenizer_info",
        "/kv_event_sources",
        "/fault_tolerance/status",
        # the API's own documentation
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/openapi.json",
    }
)
"""GET (and HEAD) routes of vLLM 0.32/0.33 that never run the model, besides reading a
stored response (``/v1/responses/{id}``).

The rule is closed: while the guard is held, a request passes only when it is known not
to run the model (these, ``PASSING_POSTS``, a stored response, an ``OPTIONS`` preflight).
Any other request, whatever its method, and every websocket, is refused, so a route a
later vLLM adds is refused, not served by a half-updated model."""


def runs_model(scope: Scope) -> bool:
    """Whether this request may run the model: true unless it is known not to (the rule:
    ``PASSING_GETS``)."""
    if scope["type"] == "websocket":
        return True
    method = scope.get("method")
    path = route_path(scope)
    if method == "OPTIONS":  # a CORS preflight: answered without reaching a route
        return False
    if method in ("GET", "HEAD"):
        return path not in PASSING_GETS and not _one_below(path, "/v1/responses/")
    if method == "POST":
        if path.startswith("/v1/responses/") and path.endswith("/cancel"):
            return not _one_below(path.removesuffix("/cancel"), "/v1/responses/")
        return path not in PASSING_POSTS
    return True


def _one_below(path: str, prefix: str) -> bool:
    """``path`` is ``prefix`` and one more segment (``/v1/responses/{id}``)."""
    rest = path.removeprefix(prefix)
    return path.startswith(prefix) and bool(rest) and "/" not in rest


@dataclass(frozen=True)
class Hold:
    """An in-place round the trainer announced and has not released."""

    round: str
    session: str | None
    since: float

    def message(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        session = f" (session {self.session})" if self.session else ""
        return (
            f"the served weights are incomplete: weight round {self.round!r}{session} is applied "
            f"in place and has not committed (since {when}), so the model may be part new, part "
            "old; requests that run the model are refused until a complete round commits (the "
            f"trainer's next round), or an operator's POST {RELEASE.path} once the workers' "
            "weights are whole"
        )

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "session": self.session, "since": self.since}


ANONYMOUS_MESSAGE = (
    "the served weights are incomplete: a weight round is applied in place and has not "
    "committed; requests that run the model are refused until it does (retry later)"
)
"""What a request without the server's API key is told while the guard is held."""


def _error(status: int, message: str, kind: str, **extra: Any) -> Reply:
    return Reply(status, {"error": {"message": message, "type": kind, "code": status, **extra}})


class RoundGuard:
    """ASGI middleware (``--middleware weightwire.vllm_guard.RoundGuard``); see the module
    docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.hold: Hold | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if kind == "http" and path.startswith(STATUS.path):
            try:
                reply = await self._control(scope, receive, path)
            except Exception as exc:  # an answer, never a traceback
                log.exception("round guard: %s failed", path)
                reply = _error(
                    500,
                    f"round guard: {type(exc).__name__}: {str(exc)[:300]}",
                    "InternalServerError",
                )
            await send_reply(send, reply)
            return
        hold = self.hold
        if hold is None or not runs_model(scope):
            await self.app(scope, receive, send)
            return
        # Refused authenticated or not: vLLM checks keys on some prefixes only, so an
        # unauthenticated request could reach the model. Only the key holder learns which
        # round, of which session, since when.
        known = authorized(scope)
        message = hold.message() if known else ANONYMOUS_MESSAGE
        if kind == "websocket":
            await receive()  # websocket.connect
            # A close reason is at most 123 bytes.
            reason = message.encode()[:120].decode(errors="ignore")
            await send({"type": "websocket.close", "code": 1013, "reason": reason})
            return
        extra: dict[str, Any] = {"round": hold.to_json()} if known else {}
        await send_reply(
            send,
            _error(
                503, message, "ServiceUnavailableError", reason="weight_round_incomplete", **extra
            ),
        )

    # ---------------------------------------------------------------- control routes
    async def _control(self, scope: Scope, receive: Receive, path: str) -> Reply:
        if not authorized(scope):
            return _error(401, "the round guard's routes need the server's API key", "Unauthorized")
        route = {r.path: r for r in (STATUS, HOLD, RELEASE)}.get(path.rstrip("/"))
        if route is None:
            return _error(404, f"no round-guard route {path!r}", "NotFound")
        if scope.get("method") != route.method:
            return _error(405, f"{route.path} takes {route.method}", "MethodNotAllowed")
        if route is STATUS:
            return Reply(200, self.status(scope))
        if route is HOLD:
            return await self._hold(scope, receive)
        return await self._release(scope)

    def status(self, scope: Scope) -> dict[str, Any]:
        count = api_server_count(scope)
        return {
            "guard": "weightwire",
            "api": GUARD_API,
            "covers": count == 1,
            "api_server_count": count,
            "held": self.hold is not None,
            "hold": None if self.hold is None else self.hold.to_json(),
            "reason": None if self.hold is None else self.hold.message(),
        }

    async def _hold(self, scope: Scope, receive: Receive) -> Reply:
        count = api_server_count(scope)
        if count != 1:
            return _error(
                409,
                f"this vLLM runs {count} API-server processes and the round guard holds one "
                "process's state: it cannot refuse the requests the others take (run one API "
                "server, --api-server-count 1, to use it)",
                "Conflict",
            )
        try:
            body = json.loads(await read_body(receive) or b"{}")
            hold = _parse_hold(body)
        except (ValueError, TypeError) as exc:
            return _error(400, f"bad hold request: {exc}", "BadRequest")
        self.hold = hold
        log.warning(
            "round guard held for round %r: requests that run the model are refused until it "
            "commits",
            hold.round,
        )
        return Reply(200, self.status(scope))

    async def _release(self, scope: Scope) -> Reply:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        resume = query.get("resume", ["true"])[-1].lower() not in ("false", "0", "no")
        checked = self.hold
        engine = engine_client(scope)
        whole, why = await workers_whole(engine)
        if not whole:
            return _error(
                409,
                f"not released: {why}; the guard keeps refusing until a complete round commits",
                "Conflict",
                held=self.hold is not None,
            )
        if self.hold is checked:  # a hold placed while the workers were asked stays
            self.hold = None
        if checked is not None:
            log.warning(
                "round guard released (round %r): the workers' weights are whole", checked.round
            )
        resumed = False
        try:
            if resume and engine is not None and await engine.is_paused():
                await engine.resume_generation()
                resumed = True
        except Exception as exc:
            return _error(
                502,
                f"the guard was released, but resuming generation failed ({type(exc).__name__}: "
                f"{str(exc)[:300]}): POST /resume",
                "BadGateway",
                released=checked is not None,
            )
        return Reply(
            200, {**self.status(scope), "released": checked is not None, "resumed": resumed}
        )


def _parse_hold(body: object) -> Hold:
    if not isinstance(body, dict):
        raise TypeError('the body must be a JSON object {"round": ..., "session": ...}')
    round_, session = body.get("round"), body.get("session")
    if not isinstance(round_, str) or not round_ or len(round_) > _MAX_TEXT:
        raise ValueError(f"'round' must be a non-empty string of at most {_MAX_TEXT} characters")
    if session is not None and (not isinstance(session, str) or len(session) > _MAX_TEXT):
        raise ValueError(f"'session' must be a string of at most {_MAX_TEXT} characters, or null")
    return Hold(round_, session, time.time())


OUT_OF_STEP = (
    "its answer is to an earlier call, not this one: vLLM's executor lost step with its "
    "workers (vLLM 0.32's multiproc executor, at tensor parallelism > 1, stops reading replies "
    "at a call's first failed worker and reads the rest a call late ever after: "
    "vllm-project/vllm#49972); restart the server"
)


async def workers_whole(engine: Any) -> tuple[bool, str]:
    """Ask every worker (``WORKER_METHOD``) whether its weights are whole: ``(whole, why not)``.

    Fail-closed: a worker that cannot tell, does not answer within ``WORKER_TIMEOUT_S``,
    answers an earlier call (``OUT_OF_STEP``), or an engine that cannot be asked, counts as
    not whole."""
    if engine is None or not callable(getattr(engine, "collective_rpc", None)):
        return False, "cannot ask the workers (no vLLM engine client in this app)"
    call = secrets.token_hex(8)
    try:
        answers = await asyncio.wait_for(
            engine.collective_rpc(WORKER_METHOD, timeout=WORKER_TIMEOUT_S, args=(call,)),
            WORKER_TIMEOUT_S,
        )
    except TimeoutError:
        return (
            False,
            f"the workers did not answer within {WORKER_TIMEOUT_S:.0f} s "
            "(a round may be in progress)",
        )
    except Exception as exc:  # vLLM wraps a worker's error in its own types
        return False, (
            f"asking the workers failed ({type(exc).__name__}: {str(exc)[:300]}); is the "
            "weightwire plugin installed in vLLM's environment?"
        )
    for rank, answer in enumerate(answers or [None]):
        if isinstance(answer, dict) and answer.get("call") != call:
            return False, f"worker {rank}: {OUT_OF_STEP}"
        if not isinstance(answer, dict) or answer.get("whole") is not True:
            why = answer.get("reason") if isinstance(answer, dict) else f"answered {answer!r:.100}"
            return False, f"worker {rank}: {why}"
    return True, ""
