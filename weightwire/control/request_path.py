"""How ``HTTPWeightSyncClient`` sends one request to a server, at the lowest fixed cost.

A colocated round is one HTTP call (the round in one request) whose fixed cost is a large
part of a small model's round (#49: a 0.5B round in <= 2 ms). Measured on loopback against
a raw uvicorn app (httptools, uvloop), per call, on a host whose Python runs as fast as the
GPU hosts' (docs/benchmarks.md §9, §22):

- ``httpx.Client.request``: its URL and header merging, cookies, auth and redirect
  machinery, httpcore's pure-Python h11 state machine: ~1 ms more than the socket.
- an ``httpx.Request`` handed to a kept-alive socket, its reply parsed by ``http.client``
  (the header parse goes through ``email``) into an ``httpx.Response``: 0.31-0.34 ms.
- the request's head kept per route (below), the reply parsed by httptools (C) into a
  ``Reply``: 0.21-0.22 ms; the socket's own round trip with a hand-written request and
  no parse: 0.12-0.16 ms.

So ``RequestPath`` writes each request itself, byte for byte as ``httpx.Client`` would (the
client's default headers, the API key; the same order): the head is built once per route,
query, header set and kind of body through ``httpx.Request`` and kept, a request then being
that head with its Content-Length and body. It goes out on ``KeepAliveTransport`` for a plain
``http://`` server reached without a proxy; otherwise (``https``, an environment proxy, the
``transport=`` a test passes) through the transport the client itself would have used. Either
way the caller gets a ``Reply`` (an ``httpx.Response``'s names for what it reads of it) and
httpx's exception classes (``TimeoutException``, ``ConnectError``, ...), so the error
mapping is unchanged; a request on a closed client is refused as ``WeightSyncError`` (no
answer), where httpx raises a bare ``RuntimeError``.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httptools
import httpx

from weightwire._trace import trace
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.routes import Route

_sent = threading.local()


@contextmanager
def on_sent(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, each request this thread sends through ``KeepAliveTransport`` calls
    ``callback`` once its bytes were written (before the reply is read): a caller that waits
    for that gives this thread the interpreter while it builds and writes the request, instead
    of contending with it. Another transport never calls it (its caller bounds its wait)."""
    before = getattr(_sent, "callback", None)
    _sent.callback = callback
    try:
        yield
    finally:
        _sent.callback = before


_KEPT = 256
"""Request heads (route, query, headers, kind of body) one server's request path keeps; when
full it starts again (a long run's re-inits each bring a session id: new heads)."""


@dataclass(frozen=True, slots=True)
class ReplyHeaders:
    """A reply's headers in order, names lower-cased."""

    pairs: tuple[tuple[str, str], ...]

    def get(self, name: str, default: str | None = None) -> str | None:
        """The header's value (any case; a repeated header's values joined by ``, ``, as
        ``httpx.Headers.get``), or ``default``."""
        name = name.lower()
        found = [v for k, v in self.pairs if k == name]
        return ", ".join(found) if found else default


@dataclass(frozen=True, slots=True)
class Reply:
    """A server's answer, read whole and decoded (gzip / deflate as httpx decodes them):
    what ``ServerSet`` reads of an answer, under an ``httpx.Response``'s names."""

    status_code: int
    reason_phrase: str
    headers: ReplyHeaders
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    @classmethod
    def of(cls, response: httpx.Response) -> Reply:
        """An ``httpx.Response`` another transport answered (read)."""
        pairs = tuple((k.lower(), v) for k, v in response.headers.multi_items())
        return cls(
            response.status_code, response.reason_phrase, ReplyHeaders(pairs), response.content
        )


@dataclass(frozen=True, slots=True)
class _Head:
    """A kept request head: ``before`` + the body's length + ``after`` (a request without
    a body: ``before`` alone is its head)."""

    before: bytes
    after: bytes


class RequestPath:
    """One server's request path (see the module docstring)."""

    def __init__(
        self,
        client: httpx.Client,
        base_url: str,
        timeout: httpx.Timeout,
        *,
        own_transport: bool,
        keepalive_expiry: float,
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.headers: list[tuple[bytes, bytes]] = list(
            client.headers.raw
        )  # raw: names keep their case
        self.extensions = {"timeout": timeout.as_dict()}
        self._heads: dict[tuple[Any, ...], _Head] = {}
        url = httpx.URL(base_url)
        pick = getattr(
            client, "_transport_for_url", None
        )  # where a future httpx lacks it: Client.send
        self.transport: httpx.BaseTransport | None = pick(url) if callable(pick) else None
        self._own: KeepAliveTransport | None = None
        # Only the client's own pool for a plain-http URL is replaced: a proxy mount (env
        # proxies) or a caller's transport stays in charge of its requests.
        if (
            own_transport
            and url.scheme == "http"
            and self.transport is not None
            and self.transport is getattr(client, "_transport", None)
        ):
            self._own = KeepAliveTransport(url.host, url.port or 80, timeout, keepalive_expiry)

    def send(
        self,
        route: Route,
        content: bytes | None,
        headers: list[tuple[bytes, bytes]],
        params: dict[str, Any] | None,
    ) -> Reply:
        """The read and closed answer (httpx exceptions as raised by the transport)."""
        if self.client.is_closed:  # never reopen a closed client's pool (as Client.send)
            raise WeightSyncError(
                route.name,
                None,
                # httpx's own words first, for callers that match them
                "Cannot send a request, as the client has been closed (close() or its "
                "engine's shutdown() ran): make a new HTTPWeightSyncClient",
                self.base_url,
            )
        if self._own is not None:
            head = self._head(route, content, headers, params)
            if content:
                data = b"%s%d%s%s" % (head.before, len(content), head.after, content)
            else:
                data = head.before
            return self._own.exchange(data)
        request = self._request(route, content, headers, params)
        if self.transport is None:
            return Reply.of(self.client.send(request))
        response = self.transport.handle_request(request)
        try:
            response.read()
        finally:
            response.close()
        response.request = request
        return Reply.of(response)

    def _request(
        self,
        route: Route,
        content: bytes | None,
        headers: list[tuple[bytes, bytes]],
        params: dict[str, Any] | None,
    ) -> httpx.Request:
        return httpx.Request(
            route.method,
            httpx.URL(self.base_url + route.path, params=params or None),
            headers=headers,
            content=content,
            extensions=self.extensions,
        )

    def _head(
        self,
        route: Route,
        content: bytes | None,
        headers: list[tuple[bytes, bytes]],
        params: dict[str, Any] | None,
    ) -> _Head:
        """The request's head, as ``httpx.Request`` writes it for this route, query, headers
        and kind of body (none, empty, some: httpx orders Content-Length by it), built once
        and kept: the Content-Length's value is all that differs between such requests."""
        # The value's type too: httpx writes True as "true", 1 as "1", 1.0 as "1.0".
        items = tuple((k, type(v), v) for k, v in params.items()) if params else ()
        body = 0 if content is None else (1 if content else 2)
        key = (route.method, route.path, items, tuple(headers), body)
        try:
            head = self._heads.get(key)
        except TypeError:  # a list in the query: not kept
            return _split_head(self._request(route, content, headers, params), content)
        if head is None:
            head = _split_head(self._request(route, content, headers, params), content)
            if len(self._heads) >= _KEPT:  # each new session's id is a new header set
                self._heads.clear()
            self._heads[key] = head
        return head

    def close(self) -> None:
        if self._own is not None:
            self._own.close()


def _split_head(request: httpx.Request, content: bytes | None) -> _Head:
    """``request``'s head; with a body, split around its Content-Length value. A CR or LF
    inside a header (an API key, a session id a server sent) is refused, as h11 would,
    instead of splitting the head."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    cut = -1
    for name, value in request.headers.raw:
        if b"\r" in name or b"\n" in name or b":" in name or b"\r" in value or b"\n" in value:
            raise httpx.LocalProtocolError(
                f"illegal header {name[:40]!r}: no CR, LF (or ':' in a name) allowed",
                request=request,
            )
        if content and name.lower() == b"content-length":
            cut = len(lines)
            lines.append(name + b": ")
        else:
            lines.append(name + b": " + value)
    lines += [b"", b""]
    if cut < 0:
        return _Head(b"\r\n".join(lines), b"")
    return _Head(b"\r\n".join(lines[: cut + 1]), b"\r\n" + b"\r\n".join(lines[cut + 1 :]))


class KeepAliveTransport:
    """HTTP/1.1 to one ``host:port``: kept-alive sockets, replies parsed by httptools.

    What it keeps from httpx's pool: an idle connection is reused only within
    ``keepalive_expiry`` and only if the server has not closed it meanwhile (a readable
    idle socket means EOF or garbage: dropped, as httpcore does), so a POST never goes
    out on a connection the server already closed; a reply that does not keep its
    connection alive (``Connection: close``, HTTP/1.0) or a 5xx reply's connection is not
    reused; the connect timeout bounds the connect, the read timeout every send and receive;
    failures raise httpx's exceptions. A request goes out as one ``sendall`` of head and body
    (on a busy host a server woken twice per request pays twice). Thread-safe: each request
    holds its socket alone.
    """

    def __init__(
        self, host: str, port: int, timeout: httpx.Timeout, keepalive_expiry: float
    ) -> None:
        self.host, self.port = host, port
        self.connect_s = timeout.connect
        self.read_s = timeout.read
        self.expiry = keepalive_expiry
        self._idle: list[tuple[float, socket.socket]] = []
        self._lock = threading.Lock()
        self._closed = False

    def _checkout(self) -> socket.socket:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                since, sock = self._idle.pop()
                if now - since < self.expiry and not _readable(sock):
                    return sock
                sock.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_s)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.read_s)
        return sock

    def exchange(self, data: bytes) -> Reply:
        """Send one request's bytes, return its reply."""
        sock = self._checkout()
        try:
            sock.sendall(data)
            trace("http sent")
            told = getattr(_sent, "callback", None)
            if told is not None:
                told()
            read = _read_reply(sock)
            trace("http read")
        except TimeoutError as exc:
            sock.close()
            raise httpx.ReadTimeout(str(exc) or "timed out") from exc
        except (httptools.HttpParserError, ConnectionError) as exc:
            sock.close()
            raise httpx.RemoteProtocolError(f"{type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            sock.close()
            raise httpx.ReadError(str(exc)) from exc
        except BaseException:
            sock.close()
            raise
        with self._lock:
            # A request in flight at close() keeps nothing. Nor does a server error: uvicorn
            # closes the connection after an unhandled exception (vLLM's reply to a worker's
            # refusal) without saying so, and the caller's next request (at once, e.g. the
            # shutdown after a failed update) would race that close and meet a reset.
            keep = read.keep and read.status < 500 and not self._closed
            if keep:
                self._idle.append((time.monotonic(), sock))
        if not keep:
            sock.close()
        return read.reply()

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for _, sock in idle:
            sock.close()


class _Reading:
    """httptools' callbacks for one reply, and what they gathered."""

    __slots__ = ("parser", "reason", "headers", "body", "status", "keep", "head_done", "done")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.status = 0
        self.keep = False
        self.head_done = self.done = False

    def on_status(self, reason: bytes) -> None:
        self.reason += reason  # may come in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        # Asked here: once the message is complete the parser has reset its state.
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True

    def until_close(self) -> bool:
        """The body is delimited by the connection's close (no length, not chunked)."""
        delimited = (b"content-length", b"transfer-encoding")
        return not any(k.lower() in delimited for k, _ in self.headers)

    def reply(self) -> Reply:
        content = b"".join(self.body)
        pairs = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in self.headers)
        if any(k == "content-encoding" and v.strip().lower() != "identity" for k, v in pairs):
            # Rare (a proxy that compresses): httpx decodes what its Accept-Encoding offered.
            content = httpx.Response(self.status, headers=self.headers, content=content).content
        return Reply(self.status, self.reason.decode("latin-1"), ReplyHeaders(pairs), content)


def _read_reply(sock: socket.socket) -> _Reading:
    reading = _Reading()
    while not reading.done:
        data = sock.recv(1 << 16)
        if not data:
            if reading.head_done and reading.until_close():
                reading.done = True
                break
            raise ConnectionError("the server closed the connection before its reply ended")
        reading.parser.feed_data(data)
    return reading


def _readable(sock: socket.socket) -> bool:
    """An idle keep-alive socket is readable only if the server closed it (or broke the
    protocol)."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True
