"""How ``HTTPWeightSyncClient`` sends one request to a server, at the lowest fixed cost.

A weight round is three calls (start / update / finish); with the bytes on a fast path
(CUDA IPC) their fixed cost is most of a small model's round (issue 19: a 0.5B round in
<= 3 ms). Measured on loopback against uvicorn + httptools on a 2-core host, per call
(``benchmarks/bench_control.py``, scratch runs interleaved):

- ``httpx.Client.request``: 1.22 ms. URL and header merging, cookie extraction through
  ``http.cookiejar``, the auth and redirect machinery: nothing these routes use.
- the same ``httpx.Request`` handed to the client's transport: 0.85 ms (httpcore alone
  0.78: its pure-Python h11 state machine and pool bookkeeping).
- stdlib ``http.client`` on a kept-alive connection: 0.52 ms.

So ``RequestPath`` builds each request itself, as ``Client.build_request`` would (the client's
default headers, the API key, the timeout), and hands it to a transport: for a plain
``http://`` server reached without a proxy, ``KeepAliveTransport`` (``http.client``
under httpx's transport interface); otherwise (``https``, an environment proxy, the
``transport=`` a test passes) the transport the client itself would have used. Either
way the caller sees httpx: ``httpx.Response`` and httpx's exception classes
(``TimeoutException``, ``ConnectError``, ...), so the error mapping is unchanged; a request
on a closed client is refused as ``WeightSyncError`` (no answer), where httpx raises a bare
``RuntimeError``.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


_KEPT_URLS = 256
"""URLs (route and query) one server's request path keeps built."""


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
        self._urls: dict[tuple[str, tuple[tuple[str, Any], ...]], httpx.URL] = {}
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
            self.transport = self._own

    def send(
        self,
        route: Route,
        content: bytes | None,
        headers: list[tuple[bytes, bytes]],
        params: dict[str, Any] | None,
    ) -> httpx.Response:
        """The read and closed response (httpx exceptions as raised by the transport)."""
        request = httpx.Request(
            route.method,
            self._url(route, params),
            headers=headers,
            content=content,
            extensions=self.extensions,
        )
        if self.client.is_closed:  # never reopen a closed client's pool (as Client.send)
            raise WeightSyncError(
                route.name,
                None,
                # httpx's own words first, for callers that match them
                "Cannot send a request, as the client has been closed (close() or its "
                "engine's shutdown() ran): make a new HTTPWeightSyncClient",
                self.base_url,
            )
        if self.transport is None:
            return self.client.send(request)
        response = self.transport.handle_request(request)
        try:
            response.read()
        finally:
            response.close()
        response.request = request
        return response

    def _url(self, route: Route, params: dict[str, Any] | None) -> httpx.URL:
        """The route's URL with ``params`` as its query, built once per route and query: a
        round's start (``pause=``) and finish (``reset_caches=&resume=``) carry one, and
        ``httpx.Request(params=...)`` merges it into the URL anew each call (~30 us)."""
        items = tuple(params.items()) if params else ()
        if not all(isinstance(v, (str, int, float)) for _, v in items):  # a list: not kept
            return httpx.URL(self.base_url + route.path, params=params)
        key = (route.path, items)
        url = self._urls.get(key)
        if url is None:
            url = httpx.URL(self.base_url + route.path, params=params or None)
            if len(self._urls) < _KEPT_URLS:
                self._urls[key] = url
        return url

    def close(self) -> None:
        if self._own is not None:
            self._own.close()


class KeepAliveTransport(httpx.BaseTransport):
    """HTTP/1.1 to one ``host:port``: kept-alive sockets, replies parsed by ``http.client``.

    What it keeps from httpx's pool: an idle connection is reused only within
    ``keepalive_expiry`` and only if the server has not closed it meanwhile (a readable
    idle socket means EOF or garbage: dropped, as httpcore does), so a POST never goes
    out on a connection the server already closed; a ``Connection: close`` or 5xx reply's
    connection is not reused; the connect timeout bounds the connect, the read timeout
    every send and receive; failures raise httpx's exceptions. Headers go out exactly as the request
    holds them (httpx added Host, Content-Length, its defaults), head and body in one
    ``sendall``: ``http.client`` sends them apart, and on a busy host the server then
    wakes twice per request. Thread-safe: each request holds its socket alone.
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

    def _checkout(self, request: httpx.Request) -> socket.socket:
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
            raise httpx.ConnectTimeout(str(exc) or "timed out", request=request) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.read_s)
        return sock

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        data = _encode(request)
        sock = self._checkout(request)
        try:
            sock.sendall(data)
            trace("http sent")
            told = getattr(_sent, "callback", None)
            if told is not None:
                told()
            reply = http.client.HTTPResponse(sock, method=request.method)
            try:
                reply.begin()
                body = reply.read()
            finally:
                reply.close()  # its file object only; the socket stays ours
            trace("http read")
        except TimeoutError as exc:
            sock.close()
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except (http.client.HTTPException, ConnectionError) as exc:
            sock.close()
            raise httpx.RemoteProtocolError(
                f"{type(exc).__name__}: {exc}", request=request
            ) from exc
        except OSError as exc:
            sock.close()
            raise httpx.ReadError(str(exc), request=request) from exc
        except BaseException:
            sock.close()
            raise
        with self._lock:
            # A request in flight at close() keeps nothing. Nor does a server error: uvicorn
            # closes the connection after an unhandled exception (vLLM's reply to a worker's
            # refusal) without saying so, and the caller's next request (at once, e.g. the
            # shutdown after a failed update) would race that close and meet a reset.
            keep = not reply.will_close and reply.status < 500 and not self._closed
            if keep:
                self._idle.append((time.monotonic(), sock))
        if not keep:
            sock.close()
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply.getheaders()]
        return httpx.Response(
            reply.status,
            headers=headers,
            content=body,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": reply.reason.encode("latin-1"),
            },
        )

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for _, sock in idle:
            sock.close()


def _encode(request: httpx.Request) -> bytes:
    """The request's bytes; a CR or LF inside a header (an API key, a session id a server
    sent) is refused, as h11 would, instead of splitting the head."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    for name, value in request.headers.raw:
        if b"\r" in name or b"\n" in name or b":" in name or b"\r" in value or b"\n" in value:
            raise httpx.LocalProtocolError(
                f"illegal header {name[:40]!r}: no CR, LF (or ':' in a name) allowed",
                request=request,
            )
        lines.append(name + b": " + value)
    lines += [b"", b""]
    return b"\r\n".join(lines) + request.content


def _readable(sock: socket.socket) -> bool:
    """An idle keep-alive socket is readable only if the server closed it (or broke the
    protocol)."""
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True
