"""Bounded HTTP GETs for ``weightwire doctor``: a probe never outlives its deadline and never
holds more than ``max_bytes`` of a reply, whatever the server does.

Why not httpx here: its timeouts bound each socket read, so a server that trickles one
byte just inside the read timeout (headers or body) keeps a request alive for ever. A
probe instead arms a timer that shuts its socket down at the deadline, which wakes the
read in progress at once, and counts the body as it arrives.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

from weightwire.shared.errors import ConfigError

MAX_REPLY_BYTES = 8 << 20
"""A probe's reply body at most (vLLM's ``/server_info`` is well under 1 MiB)."""


@dataclass(frozen=True)
class Reply:
    """What one probe got: ``status`` None when no complete answer came (``body`` then says why)."""

    status: int | None
    body: Any


class Prober:
    """GETs against one base URL, each bounded by ``timeout`` and all by ``deadline``
    (monotonic)."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str],
        timeout: float,
        deadline: float,
        max_bytes: int = MAX_REPLY_BYTES,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"not an http(s) URL: {base_url!r}: give http://HOST:PORT")
        self._parts = parts
        self._headers = {"Accept": "application/json", **headers}
        self.timeout, self.deadline, self.max_bytes = timeout, deadline, max_bytes

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def get(self, path: str, **params: Any) -> Reply:
        limit = min(self.timeout, self.deadline - time.monotonic())
        if limit <= 0:
            return Reply(None, "not sent: the doctor's overall deadline had passed")
        target = (self._parts.path.rstrip("/") + path) + (f"?{urlencode(params)}" if params else "")
        conn = self._connection(limit)
        fired = threading.Event()
        timer = threading.Timer(limit, _shut, args=(conn, fired))
        timer.daemon = True
        timer.start()
        try:
            conn.request("GET", target, headers=self._headers)
            response = conn.getresponse()
            raw = self._read(response, time.monotonic() + limit, limit)
        except (OSError, http.client.HTTPException) as exc:
            if not fired.is_set():
                return Reply(None, f"{type(exc).__name__}: {exc}")
        finally:
            timer.cancel()
            conn.close()
        if fired.is_set():  # our timer shut the socket: whatever came is cut short by the deadline
            return Reply(None, f"no complete answer within {limit:g} s")
        if isinstance(raw, str):  # _read stopped early and says why
            return Reply(None, raw)
        try:
            return Reply(response.status, json.loads(raw))
        except ValueError:
            return Reply(response.status, raw[:200].decode("utf-8", "replace"))

    def _connection(self, limit: float) -> http.client.HTTPConnection:
        cls = (
            http.client.HTTPSConnection
            if self._parts.scheme == "https"
            else http.client.HTTPConnection
        )
        return cls(self._parts.hostname or "", self._parts.port, timeout=limit)

    def _read(
        self, response: http.client.HTTPResponse, deadline: float, limit: float
    ) -> bytes | str:
        """The whole body, or why reading it stopped (size cap, deadline)."""
        body = bytearray()
        while chunk := response.read1(1 << 16):
            body += chunk
            if len(body) > self.max_bytes:
                return f"a reply body over {self.max_bytes >> 20} MiB; stopped reading it"
            if time.monotonic() >= deadline:
                return f"no complete answer within {limit:g} s"
        return bytes(body)


def _shut(conn: http.client.HTTPConnection, fired: threading.Event) -> None:
    fired.set()
    sock = conn.sock
    if sock is not None:
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
