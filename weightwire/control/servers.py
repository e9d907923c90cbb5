"""``ServerSet``: one or more vLLM servers' HTTP routes, called as one.

The plumbing under ``client.HTTPWeightSyncClient``: one kept-alive connection per server
(``request_path.RequestPath``), the session header on the routes an init's session owns,
every non-2xx answer or transport failure as a ``WeightSyncError`` naming the route and the
server, and one call on every server concurrently (``fanout.fan_out``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import httpx

from weightwire.control.errors import server_error_field, server_message
from weightwire.control.fanout import fan_out
from weightwire.control.request_path import RequestPath
from weightwire.shared import routes
from weightwire.shared.checks import check_seconds
from weightwire.shared.errors import ConfigError, WeightSyncError
from weightwire.shared.routes import (
    REFUSAL_FIELD,
    SESSION_HEADER,
    START_PAUSE_FIELD,
    Route,
    server_url,
)

_OWNED = frozenset(r.name for r in (routes.START, routes.UPDATE, routes.FINISH, routes.SHUTDOWN))
"""Routes that carry the session id an init reply returned (``SESSION_HEADER``)."""


_KEEPALIVE_S = 2.0
_LIMITS = httpx.Limits(keepalive_expiry=_KEEPALIVE_S)
"""Idle connections are dropped before uvicorn's 5 s keep-alive (vLLM's and ours) closes them:
a POST on a connection the server just closed fails with a reset and is never retried."""


_JSON = (b"Content-Type", b"application/json")
_SESSION_KEY = SESSION_HEADER.encode("ascii")


def server_urls(base_url: str | Sequence[str]) -> list[str]:
    """One or more servers' base URLs, each read by ``routes.server_url`` (a bare
    ``host:port`` is ``http://host:port``); ``ConfigError`` for none, one that is not a URL,
    or the same server twice."""
    if isinstance(base_url, str):
        urls = [base_url]
    elif isinstance(base_url, Sequence):
        urls = list(base_url)
    else:
        raise ConfigError(
            "base_url must be a server URL (http://127.0.0.1:8000) or a list of them, got "
            f"{type(base_url).__name__}"
        )
    if not urls:
        raise ConfigError("base_url is an empty list: give at least one server URL")
    normal = [server_url(u) for u in urls]
    if len(set(normal)) != len(normal):
        raise ConfigError(
            f"base_url lists the same server twice ({urls!r:.200}); every replica would get "
            "each call twice: list each server once"
        )
    return normal


class ServerSet:
    """The servers behind one client: ``base_urls[i]`` is server ``i``."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        timeout: float = 300,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_urls = server_urls(base_url)
        check_seconds("timeout", timeout)
        self.timeout = float(timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        http_timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, 30.0))
        self._clients = [
            httpx.Client(
                base_url=u,
                timeout=http_timeout,
                headers=headers,
                transport=transport,
                limits=_LIMITS,
            )
            for u in self.base_urls
        ]
        self._paths = [
            RequestPath(
                c, u, http_timeout, own_transport=transport is None, keepalive_expiry=_KEEPALIVE_S
            )
            for c, u in zip(self._clients, self.base_urls, strict=True)
        ]
        self._sessions: list[str | None] = [None] * len(self.base_urls)
        """Per server: the ``session_id`` its last init returned (servers that return none:
        None)."""
        self._counted = threading.Lock()
        self.http_calls = 0
        """HTTP requests sent so far, every server's (a trainer round reports its share:
        ``RoundMetrics.http_calls``)."""

    def _request(
        self, i: int, route: Route, body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        server = self.base_urls[i]
        session = self._sessions[i]
        path = self._paths[i]
        headers = path.headers
        if body is not None:
            content = json.dumps(body).encode()
            headers = [*headers, _JSON]
        else:
            content = None
        if session is not None and route.name in _OWNED:
            headers = [
                *headers,
                (_SESSION_KEY, session.encode("ascii")),
            ]  # as httpx encodes a str header
        with self._counted:
            self.http_calls += 1
        try:
            response = path.send(route, content, headers, params)
        except httpx.TimeoutException as exc:
            raise WeightSyncError(
                route.name,
                None,
                f"no answer within {self.timeout} s ({type(exc).__name__})",
                server,
            ) from None
        except httpx.HTTPError as exc:
            raise WeightSyncError(
                route.name, None, f"{type(exc).__name__}: {exc}", server
            ) from None
        if not 200 <= response.status_code < 300:
            fallback = response.reason_phrase or "error"
            # A refused start says what became of the pause it carried (START_PAUSE_FIELD),
            # also from inside an update that carried it (the round in one request).
            pause = (
                server_error_field(response.content, START_PAUSE_FIELD)
                if route is routes.START or route is routes.UPDATE
                else None
            )
            raise WeightSyncError(
                route.name,
                response.status_code,
                server_message(response.content, fallback=fallback),
                server,
                pause=pause,
                refusal=server_error_field(response.content, REFUSAL_FIELD),
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    def _all(
        self,
        route: Route,
        body: Any = None,
        params: dict[str, Any] | None = None,
        bodies: Sequence[Any] | None = None,
    ) -> list[Any]:
        """Call ``route`` on every server (``bodies[i]`` for server i when given)."""
        if len(self._clients) == 1:  # the common case: no closures, no fan-out bookkeeping
            return [self._request(0, route, body if bodies is None else bodies[0], params)]
        calls = [
            (lambda i=i: self._request(i, route, body if bodies is None else bodies[i], params))
            for i in range(len(self._clients))
        ]
        # Each call is bounded by the httpx timeout; the outer bound only guards a stuck thread.
        return fan_out(calls, timeout=self.timeout + 30.0, name=f"weightwire-{route.name}")

    def close(self) -> None:
        for path in self._paths:
            path.close()
        for client in self._clients:
            client.close()
