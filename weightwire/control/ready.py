"""``wait_until_ready``: a bounded wait for servers that are still starting.

A trainer launched beside its server (one job script, two processes) reaches it before it
listens: ``weightwire serve`` loads its model for seconds, vLLM for minutes. Without a wait
the first call fails at once (connection refused); with an unbounded one a server that never
comes up hangs the trainer. So: poll ``GET /health`` (vLLM and ``weightwire serve`` both
answer it, 200 once they serve) on every server until each answered 200, and raise
``ServerNotReady`` naming the server, the time waited and the last answer once ``timeout``
has passed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import httpx

from weightwire.control.servers import server_urls
from weightwire.shared import routes
from weightwire.shared.checks import check_seconds
from weightwire.shared.errors import WeightSyncError

FIRST_POLL_S = 0.1
"""The pause after a first failed poll; it doubles up to ``MAX_POLL_S``."""
MAX_POLL_S = 1.0
"""A server that comes up is seen within a second (a poll is one cheap GET on loopback)."""
PROBE_S = 5.0
"""One poll's own bound: a server that accepts but does not answer is asked again."""


class ServerNotReady(WeightSyncError, TimeoutError):
    """A server did not answer ``GET /health`` with 200 within the wait's timeout.

    A ``WeightSyncError`` (``route`` ``"health"``; ``status`` the last HTTP status, ``None``
    when nothing answered), so one ``except WeightSyncError`` covers it; also a
    ``TimeoutError``. ``waited`` is how long it waited, in seconds.
    """

    def __init__(self, server: str, waited: float, last: str, status: int | None) -> None:
        self.route, self.status, self.server = routes.HEALTH.name, status, server
        self.waited = waited
        self.message = (
            f"the server at {server} was not ready after {waited:.1f} s (last GET /health: "
            f"{last}): start it, check the URL, or wait longer (a larger timeout / ready_timeout)"
        )
        Exception.__init__(self, self.message)  # not WeightSyncError's "<route> failed" text
        self.last = last
        """The last poll's outcome (``status 503``, ``ConnectError: ...``)."""

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.server, self.waited, self.last, self.status))


def wait_until_ready(
    url_or_urls: str | Sequence[str],
    timeout: float = 120.0,
    *,
    api_key: str | None = None,
) -> list[str]:
    """Wait until every server answers ``GET /health`` with 200; return their base URLs.

    ``url_or_urls``: one base URL or a list (a bare ``host:port`` means ``http://host:port``).
    ``timeout`` (seconds, > 0) bounds the whole wait, for all servers together. Raises
    ``ServerNotReady`` for the first server still not ready when it expires, ``ConfigError``
    for a URL that is not one (before any request).
    """
    urls = server_urls(url_or_urls)
    check_seconds("timeout", timeout)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    deadline = start + timeout
    waiting: dict[str, tuple[str, int | None]] = {url: ("no answer yet", None) for url in urls}
    pause = FIRST_POLL_S
    with httpx.Client(headers=headers) as http:
        while True:
            for url in list(waiting):
                left = deadline - time.monotonic()
                probe = httpx.Timeout(max(min(PROBE_S, left), 0.01))
                try:
                    reply = http.get(url + routes.HEALTH.path, timeout=probe)
                except httpx.HTTPError as exc:
                    waiting[url] = (f"{type(exc).__name__}: {exc}".rstrip(": "), None)
                    continue
                if reply.status_code == 200:
                    del waiting[url]
                else:
                    waiting[url] = (f"status {reply.status_code}", reply.status_code)
            if not waiting:
                return urls
            now = time.monotonic()
            if now >= deadline:
                url = next(iter(waiting))
                last, status = waiting[url]
                raise ServerNotReady(url, now - start, last, status)
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, MAX_POLL_S)
