"""``HTTPWeightSyncClient`` over a real loopback socket: what reaches the socket is what
``httpx.Client.request`` would send, and every failure (no answer in time, refused,
closed client) maps as it did. The client hands its requests to the transport directly
(``request_path.RequestPath``); these tests pin that the shortcut changed nothing a server
can see."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from weightwire.control import HTTPWeightSyncClient
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.routes import SESSION_HEADER

pytestmark = pytest.mark.timeout(60)


class WireServer:
    """HTTP/1.1 on loopback: records each request's head and body, answers ``reply``
    (or never, while ``silent``); keeps connections alive like uvicorn."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[tuple[list[tuple[str, str]], bytes]] = []
        self.reply = (200, b'{"message": "ok", "session_id": "sess-1"}')
        self.silent = False
        self.close_after_reply = (
            False  # close the connection without saying so (an idle-timeout close)
        )
        self.reply_headers = b""
        self.raw_reply: bytes | None = None  # sent instead of ``reply``, then closed: say so
        self.before_reply: Any = None  # called once a request was read, before its reply
        # Which connection each request came on (numbered as they first carry one: a stray
        # connect from elsewhere on the host that sends nothing is not counted), and how many
        # connections the server itself closed after a reply.
        self.came_on: list[int] = []
        self.server_closes = 0
        self._carrying = 0
        self._changed = threading.Condition()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        number: int | None = None
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                headers = [(k, v.strip()) for k, _, v in (h.partition(":") for h in lines[1:])]
                length = int(dict((k.lower(), v) for k, v in headers).get("content-length", "0"))
                while len(buf) < length:
                    buf += conn.recv(65536)
                body, buf = buf[:length], buf[length:]
                if number is None:
                    number, self._carrying = self._carrying, self._carrying + 1
                self.came_on.append(number)
                self.requests.append(([("request-line", lines[0]), *headers], body))
                if self.silent:
                    continue
                if self.before_reply is not None:
                    self.before_reply()
                if self.raw_reply is not None:
                    conn.sendall(self.raw_reply)
                    conn.close()
                    return
                status, payload = self.reply
                conn.sendall(
                    b"HTTP/1.1 %d X\r\n"
                    b"content-type: application/json\r\n"
                    b"content-length: %d\r\n"
                    b"%s\r\n"
                    b"%s" % (status, len(payload), self.reply_headers, payload)
                )
                if self.close_after_reply:
                    conn.close()
                    with self._changed:
                        self.server_closes += 1
                        self._changed.notify_all()
                    return

    def wait_server_closes(self, count: int) -> None:
        """Until the server has closed ``count`` connections after a reply (bounded)."""
        with self._changed:
            assert self._changed.wait_for(lambda: self.server_closes >= count, timeout=10), (
                f"the server closed {self.server_closes} connections, not {count}"
            )

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def server() -> Iterator[WireServer]:
    s = WireServer()
    yield s
    s.close()


def test_requests_on_the_wire_equal_what_httpx_client_sends(server: WireServer) -> None:
    client = HTTPWeightSyncClient(server.url, timeout=5, api_key="k-1")
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 2})
    client.start_weight_update()
    client.update_weights({"names": [], "dtype_names": [], "shapes": []})
    client.finish_weight_update("v7")
    client.pause("keep", clear_cache=False)
    client.weight_info()
    ours = list(server.requests)
    server.requests.clear()
    # The same calls through httpx.Client.request, as the client made them before the shortcut.
    plain = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer k-1"})
    json_h = {"Content-Type": "application/json"}
    owned = {**json_h, SESSION_HEADER: "sess-1"}
    plain.post(
        "/init_weight_transfer_engine",
        content=b'{"init_info": {"rank_offset": 1, "world_size": 2}}',
        headers=json_h,
    )
    plain.post("/start_weight_update", headers={SESSION_HEADER: "sess-1"})
    plain.post(
        "/update_weights",
        content=b'{"update_info": {"names": [], "dtype_names": [], "shapes": []}}',
        headers=owned,
    )
    plain.post("/finish_weight_update", content=b'{"weight_version": "v7"}', headers=owned)
    plain.post("/pause", params={"mode": "keep", "clear_cache": "false"})
    plain.get("/weight_info")
    assert ours == server.requests
    assert ("Authorization", "Bearer k-1") in ours[0][0] and (SESSION_HEADER, "sess-1") in ours[1][
        0
    ]
    client.close()
    plain.close()


def test_no_answer_in_time_maps_to_a_timeout_error(server: WireServer) -> None:
    server.silent = True
    client = HTTPWeightSyncClient(server.url, timeout=0.3)
    with pytest.raises(
        WeightSyncError,
        match=r"start_weight_update failed on .* \(no response\): no answer within "
        r"0\.3 s \(ReadTimeout\)",
    ) as info:
        client.start_weight_update()
    assert info.value.status is None and info.value.server == server.url


def test_refused_connection_and_error_status_map_as_before(server: WireServer) -> None:
    server.reply = (
        409,
        b'{"error": {"message": "a weight update is already active"}, "detail": "x"}',
    )
    client = HTTPWeightSyncClient(server.url, timeout=5)
    with pytest.raises(WeightSyncError) as info:
        client.start_weight_update()
    assert (info.value.route, info.value.status, info.value.message) == (
        "start_weight_update",
        409,
        "a weight update is already active",
    )
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    fresh = HTTPWeightSyncClient(f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(WeightSyncError, match=r"\(no response\): ConnectError") as info:
        fresh.finish_weight_update("v")
    assert info.value.status is None


def test_a_closed_client_refuses_like_httpx(server: WireServer) -> None:
    """A call after ``close()`` is a ``WeightSyncError`` (no response; still a
    ``RuntimeError`` with httpx's words) naming the route, the server and the fix, on the
    kept-alive path and on httpx's own (a caller's transport); was a bare ``RuntimeError``."""
    client = HTTPWeightSyncClient(server.url, timeout=5)
    client.start_weight_update()
    client.close()
    for closed in (client, HTTPWeightSyncClient(server.url, transport=httpx.HTTPTransport())):
        closed.close()
        with pytest.raises(
            WeightSyncError,
            match=r"start_weight_update failed on .* \(no response\): Cannot send a request, "
            r"as the client has been closed .*make a new HTTPWeightSyncClient",
        ) as info:
            closed.start_weight_update()
        assert isinstance(info.value, RuntimeError) and info.value.status is None
        assert info.value.server == server.url


def _until_idle_sockets_show_the_close(client: HTTPWeightSyncClient) -> None:
    import time

    from weightwire.control.request_path import _readable

    transport: Any = client._paths[0]._own
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with transport._lock:
            idle = [sock for _, sock in transport._idle]
        if all(_readable(sock) for sock in idle):
            return
        time.sleep(0.001)


def test_kept_alive_connections_are_reused_only_while_the_server_keeps_them(
    server: WireServer,
) -> None:
    import time

    from weightwire.control import servers

    client = HTTPWeightSyncClient(server.url, timeout=5)
    for _ in range(3):
        client.start_weight_update()
    server.close_after_reply = True  # the server now closes every connection after its reply
    for closed in range(3):
        # The server's close has landed before the next request (as an idle-timeout close
        # would): waited for, not slept for, so a busy host cannot reorder it; on a loaded
        # host the kernel may deliver the close's FIN a moment after close() returned, so
        # the wait ends once the client's idle socket shows it.
        server.wait_server_closes(closed)
        if closed:
            _until_idle_sockets_show_the_close(client)
        client.start_weight_update()  # never sent on a closed one: a closed idle socket is dropped
    server.wait_server_closes(3)
    server.close_after_reply = False
    server.reply_headers = b"connection: close\r\n"
    client.start_weight_update()
    client.start_weight_update()
    server.reply_headers = b""
    client.start_weight_update()
    client.start_weight_update()
    time.sleep(servers._KEEPALIVE_S + 0.2)  # idle past the expiry: dropped, not reused
    client.start_weight_update()
    assert server.came_on == [
        *(0, 0, 0),  # one kept-alive connection
        *(0, 1, 2),  # the first after the flag still went out on the live connection
        *(3, 4),  # a "Connection: close" reply is not reused
        *(5, 5),  # kept alive again
        6,  # expired
    ]


def test_a_server_error_reply_is_not_reused(server: WireServer) -> None:
    """uvicorn closes the connection after an unhandled exception (a 500) without saying
    so: the next request, sent at once, goes out on a fresh connection, not into that close."""
    client = HTTPWeightSyncClient(server.url, timeout=5)
    client.start_weight_update()
    server.reply = (500, b"Internal Server Error")
    with pytest.raises(WeightSyncError) as info:
        client.finish_weight_update("v")
    assert info.value.status == 500 and server.came_on == [0, 0]
    server.reply = (200, b'{"message": "ok"}')
    client.shutdown_weight_transfer_engine()
    assert server.came_on == [0, 0, 1]


def test_compressed_replies_are_decoded(server: WireServer) -> None:
    import gzip

    server.reply = (200, gzip.compress(b'{"weight_version": "v3"}'))
    server.reply_headers = b"content-encoding: gzip\r\n"
    client = HTTPWeightSyncClient(server.url, timeout=5)
    assert client.weight_info() == [{"weight_version": "v3"}]


def test_replies_chunked_or_ended_by_the_close_are_read_whole_and_a_cut_one_fails(
    server: WireServer,
) -> None:
    """The reply's framing is the server's choice (a proxy may chunk it, an HTTP/1.0 one end
    it by closing): each is read whole; a reply cut short by a close is an error, never a
    truncated body taken as the answer."""
    client = HTTPWeightSyncClient(server.url, timeout=5)
    body = b'{"weight_version": "v9"}'
    server.raw_reply = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"transfer-encoding: chunked\r\n\r\n5\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (body[:5], len(body) - 5, body[5:])
    )
    assert client.weight_info() == [{"weight_version": "v9"}]
    server.raw_reply = b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + body
    assert client.weight_info() == [{"weight_version": "v9"}]
    server.raw_reply = b"HTTP/1.1 200 OK\r\ncontent-length: 40\r\n\r\n" + body
    with pytest.raises(WeightSyncError, match=r"\(no response\): RemoteProtocolError: .*closed"):
        client.weight_info()
    server.raw_reply = b"HTTP/1.1 404 Gone Away\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
    with pytest.raises(WeightSyncError, match=r"\(status 404\): Gone Away") as info:
        client.weight_info()
    assert info.value.status == 404
    server.raw_reply = b"garbage\r\n\r\n"
    with pytest.raises(WeightSyncError, match=r"\(no response\): RemoteProtocolError"):
        client.weight_info()
    client.close()


def test_a_session_id_with_a_line_break_never_splits_the_request_head(server: WireServer) -> None:
    server.reply = (200, b'{"session_id": "s\\r\\nX-Injected: 1"}')
    client = HTTPWeightSyncClient(server.url, timeout=5)
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 2})
    with pytest.raises(
        WeightSyncError, match=r"\(no response\): LocalProtocolError: illegal header"
    ):
        client.start_weight_update()
    assert not any(k.lower() == "x-injected" for head, _ in server.requests for k, _ in head)


def _as_httpx_sends_starts(server: WireServer, queries: list[dict[str, Any]]) -> list[Any]:
    """The requests ``server`` recorded (then forgotten) after asserting they equal what
    ``httpx.Client`` sends for a start with each of ``queries``."""
    ours = list(server.requests)
    server.requests.clear()
    with httpx.Client(base_url=server.url) as plain:
        for params in queries:
            plain.post("/start_weight_update", params=params)
    assert ours == server.requests
    return ours


def test_a_query_built_once_per_route_goes_out_as_httpx_writes_it(server: WireServer) -> None:
    from weightwire.shared import routes

    client = HTTPWeightSyncClient(server.url, timeout=5)
    queries = [
        {"pause": "abort"},
        {"pause": "abort"},  # the second time from the kept URL
        {"reset_caches": "true", "resume": True},
        {"tags": ["weights", "kv_cache"]},  # a list: built each time, not kept
        {"level": 1, "mode": "wait"},
        {},
    ]
    for params in queries:
        client._request(0, routes.START, None, params)
    ours = _as_httpx_sends_starts(server, queries)
    lines = [head[0][1] for head, _ in ours]
    assert lines[1] == "POST /start_weight_update?pause=abort HTTP/1.1"
    assert lines[2] == "POST /start_weight_update?reset_caches=true&resume=true HTTP/1.1"
    assert lines[3] == "POST /start_weight_update?tags=weights&tags=kv_cache HTTP/1.1"
    assert lines[5] == "POST /start_weight_update HTTP/1.1"
    assert len(client._paths[0]._heads) == 4  # one per route and query, the list's not kept
    client.close()


def test_on_sent_tells_the_calling_thread_once_its_request_left_before_the_reply(
    server: WireServer,
) -> None:
    """``on_sent``: the round's one request lets its data path go on once its bytes were
    written; the server here answers only after the callback ran (else it records False)."""
    from weightwire.control.request_path import on_sent

    told = threading.Event()
    seen: list[bool] = []
    server.before_reply = lambda: seen.append(told.wait(5.0))
    client = HTTPWeightSyncClient(server.url)
    with on_sent(told.set):
        client.start_weight_update()
    assert seen == [True]
    told.clear()
    server.before_reply = lambda: seen.append(told.is_set())
    client.start_weight_update()  # outside the block: nobody is told
    assert seen == [True, False] and not told.is_set()
    client.close()


def test_kept_heads_stay_bounded_and_every_request_still_goes_out_as_httpx_writes_it(
    server: WireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightwire.control import request_path
    from weightwire.shared import routes

    monkeypatch.setattr(request_path, "_KEPT", 3)
    client = HTTPWeightSyncClient(server.url, timeout=5)
    queries = [{"pause": f"p{i % 5}"} for i in range(12)]
    for params in queries:
        client._request(0, routes.START, None, params)
        assert len(client._paths[0]._heads) <= 3
    _as_httpx_sends_starts(server, queries)
    client.close()
