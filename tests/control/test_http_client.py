"""HTTPWeightSyncClient against fake servers (httpx.MockTransport)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from weightwire.control import HTTPWeightSyncClient, NotAdvertised
from weightwire.shared.errors import ConfigError, WeightSyncError


class Servers:
    """Several fake vLLM servers behind one transport, told apart by host."""

    def __init__(self, world: dict[str, int], versions: dict[str, str] | None = None) -> None:
        self.world = world
        self.versions = versions or {}
        self.seen: list[tuple[str, str, str, object, dict[str, str]]] = []
        self.responses: dict[tuple[str, str], httpx.Response] = {}
        self.block: dict[tuple[str, str], threading.Event] = {}
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        body = json.loads(request.content) if request.content else None
        with self.lock:
            self.seen.append((host, request.method, path, body, dict(request.url.params)))
        if (host, path) in self.block:
            self.block[host, path].wait(10)
        if (host, path) in self.responses:
            return self.responses[host, path]
        if path == "/get_world_size":
            return httpx.Response(200, json={"world_size": self.world[host]})
        if path == "/version":
            return httpx.Response(200, json={"version": self.versions.get(host, "0.33.0")})
        return httpx.Response(200, json={"message": "ok"})

    def client(self, **kw: object) -> HTTPWeightSyncClient:
        urls = [f"http://{h}:8000" for h in self.world]
        return HTTPWeightSyncClient(
            urls if len(urls) > 1 else urls[0], timeout=5, transport=httpx.MockTransport(self), **kw
        )

    def calls(self, path: str) -> list[tuple[str, object]]:
        return sorted((h, b) for h, _, p, b, _ in self.seen if p == path)


def test_the_four_calls_send_vllm_bodies() -> None:
    servers = Servers({"a": 2})
    client = servers.client()
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 3})
    client.start_weight_update()
    client.update_weights({"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
    client.finish_weight_update()
    client.finish_weight_update("7")
    got = [(m, p, b) for _, m, p, b, _ in servers.seen]
    assert got == [
        (
            "POST",
            "/init_weight_transfer_engine",
            {"init_info": {"rank_offset": 1, "world_size": 3}},
        ),
        ("POST", "/start_weight_update", None),
        (
            "POST",
            "/update_weights",
            {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}},
        ),
        ("POST", "/finish_weight_update", None),
        ("POST", "/finish_weight_update", {"weight_version": "7"}),
    ]


def test_errors_carry_route_status_message_and_server() -> None:
    servers = Servers({"a": 1})
    servers.responses["a", "/update_weights"] = httpx.Response(
        400, json={"error": "names[0] must be a non-empty string"}
    )
    servers.responses["a", "/init_weight_transfer_engine"] = httpx.Response(
        422,
        json={
            "detail": [{"loc": ["body", "init_info"], "msg": "Field required", "type": "missing"}]
        },
    )
    servers.responses["a", "/start_weight_update"] = httpx.Response(
        500, text="Internal Server Error"
    )
    servers.responses["a", "/finish_weight_update"] = httpx.Response(
        500,
        json={
            "error": {
                "message": "finish_weight_update called without start",
                "type": "InternalServerError",
            }
        },
    )
    client = servers.client()
    with pytest.raises(WeightSyncError) as info:
        client.update_weights({"names": [""], "dtype_names": ["float32"], "shapes": [[1]]})
    e = info.value
    assert (e.route, e.status, e.message, e.server) == (
        "update_weights",
        400,
        "names[0] must be a non-empty string",
        "http://a:8000",
    )
    assert str(e) == (
        "update_weights failed on http://a:8000 (status 400): names[0] must be a non-empty string"
    )
    with pytest.raises(WeightSyncError, match=r"status 422\): body\.init_info: Field required"):
        client.init_weight_transfer_engine({})
    with pytest.raises(
        WeightSyncError, match=r"start_weight_update .*status 500\): Internal Server Error"
    ):
        client.start_weight_update()
    with pytest.raises(WeightSyncError, match="called without start"):
        client.finish_weight_update("1")


def test_no_response_is_an_error_with_no_status() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    client = HTTPWeightSyncClient("http://down:1", transport=httpx.MockTransport(refuse))
    with pytest.raises(
        WeightSyncError,
        match=r"start_weight_update failed on http://down:1 \(no response\): ConnectError",
    ) as info:
        client.start_weight_update()
    assert info.value.status is None


def test_several_servers_are_driven_as_one() -> None:
    servers = Servers({"a": 2, "b": 4, "c": 1})
    client = servers.client()
    assert client.get_world_size() == 7
    assert client.world_sizes == [2, 4, 1]
    client.init_weight_transfer_engine(
        {"nccl_unique_id_b64": "x", "rank_offset": 1, "world_size": 8}
    )
    offsets = {
        h: b["init_info"]["rank_offset"] for h, b in servers.calls("/init_weight_transfer_engine")
    }
    assert offsets == {"a": 1, "b": 3, "c": 7}  # each server's workers get their own ranks
    client.start_weight_update()
    client.update_weights({"names": [], "dtype_names": [], "shapes": []})
    client.finish_weight_update("3")
    for path in ("/start_weight_update", "/update_weights", "/finish_weight_update"):
        assert [h for h, _ in servers.calls(path)] == ["a", "b", "c"]
    assert client.version() == "0.33.0"
    queries = sorted(q["include_dp"] for _, _, p, _, q in servers.seen if p == "/get_world_size")
    assert queries == ["false"] * 3 + ["true"] * 3  # with and without DP: none of them runs DP
    assert not [p for _, _, p, _, _ in servers.seen if p == "/server_info"]


def test_servers_that_disagree_on_version_are_refused() -> None:
    client = Servers({"a": 1, "b": 1}, versions={"b": "0.32.0"}).client()
    with pytest.raises(
        ValueError, match=r"different versions \(http://a:8000=0\.33\.0, http://b:8000=0\.32\.0\)"
    ):
        client.version()


def test_first_failure_is_raised_without_waiting_for_a_blocked_replica() -> None:
    servers = Servers({"a": 1, "b": 1})
    servers.block["a", "/update_weights"] = release = threading.Event()  # replica a still receiving
    servers.responses["b", "/update_weights"] = httpx.Response(500, json={"error": "worker 1 died"})
    client = servers.client()
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"http://b:8000 \(status 500\): worker 1 died"):
        client.update_weights({"names": [], "dtype_names": [], "shapes": []})
    assert time.monotonic() - start < 2.0
    release.set()


def test_pause_resume_checker_info_and_auth() -> None:
    servers = Servers({"a": 1})
    client = servers.client(api_key="sk-secret-123")
    client.pause("wait")
    client.pause(clear_cache=False)
    client.resume()
    client.weight_checker("checksum")
    client.weight_checker("compare", baseline={"w": "ab"})
    assert client.weight_info() == [{"message": "ok"}]
    client.shutdown_weight_transfer_engine()
    seen = [(p, b, q) for _, _, p, b, q in servers.seen]
    assert seen[:6] == [
        ("/version", None, {}),  # before any init: does the server bound a wait? (stock: no)
        ("/pause", None, {"mode": "wait"}),
        ("/pause", None, {"mode": "keep", "clear_cache": "false"}),
        ("/resume", None, {}),
        ("/weight_checker", {"action": "checksum"}, {}),
        ("/weight_checker", {"action": "compare", "baseline": {"w": "ab"}}, {}),
    ]
    assert seen[-1][0] == "/shutdown_weight_transfer_engine"
    with pytest.raises(ValueError, match="pause mode must be one of"):
        client.pause("drop")
    with pytest.raises(ValueError, match="weight_checker action must be one of"):
        client.weight_checker("reload")
    assert "sk-secret" not in repr(client)


def test_api_key_travels_as_bearer_token() -> None:
    headers: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("authorization"))
        return httpx.Response(200, json={})

    HTTPWeightSyncClient(
        "http://a:1", api_key="k1", transport=httpx.MockTransport(handler)
    ).resume()
    HTTPWeightSyncClient("http://a:1", transport=httpx.MockTransport(handler)).resume()
    assert headers == ["Bearer k1", None]


def test_bad_construction_is_refused() -> None:
    # A bare host:port is the CLI's reading too: http:// (issue #50).
    assert HTTPWeightSyncClient("vllm:8000").base_urls == ["http://vllm:8000"]
    with pytest.raises(ConfigError, match="'ftp://vllm:8000' is not a server URL .*http://"):
        HTTPWeightSyncClient("ftp://vllm:8000")
    with pytest.raises(ConfigError, match="same server twice"):
        HTTPWeightSyncClient(["http://a:1", "a:1/"])
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        HTTPWeightSyncClient("http://a:1", timeout=0)


def test_a_round_call_no_server_advertised_is_refused_naming_the_servers() -> None:
    """``pause_and_start`` / ``finish_reset_resume`` / ``update_and_finish`` /
    ``start_update_finish`` where a server's init reply did not name their feature, or before
    any init: ``NotAdvertised`` (a ``ConfigError`` and still a ``RuntimeError``) naming the
    servers that lack it and the plain calls to make instead; nothing is sent (was a bare
    ``RuntimeError('not every server advertised ...')`` naming no server)."""
    from weightwire.shared.routes import (
        FINISH_RESETS_RESUMES,
        START_PAUSES,
        UPDATE_FINISHES,
        UPDATE_STARTS,
    )

    everything = [START_PAUSES, FINISH_RESETS_RESUMES, UPDATE_FINISHES, UPDATE_STARTS]
    servers = Servers({"a": 1, "b": 1})
    servers.responses["a", "/init_weight_transfer_engine"] = httpx.Response(
        200, json={"features": everything}
    )
    servers.responses["b", "/init_weight_transfer_engine"] = httpx.Response(
        200, json={"features": [START_PAUSES]}
    )
    client = servers.client()
    calls = {
        START_PAUSES: (lambda: client.pause_and_start("wait"), "pause\\(mode\\) then start"),
        FINISH_RESETS_RESUMES: (lambda: client.finish_reset_resume("v"), "finish_weight_upd"),
        UPDATE_FINISHES: (
            lambda: client.update_and_finish({}, "v", reset_caches=True, resume=True),
            "update_weights\\(update_info\\) then finish_weight_update",
        ),
        UPDATE_STARTS: (
            lambda: client.start_update_finish({}, "v", pause=None, reset_caches=True, resume=True),
            "start_weight_update\\(\\), update_weights",
        ),
    }
    for feature, (call, instead) in calls.items():
        with pytest.raises(
            NotAdvertised, match=f"'{feature}' at init, but no init_weight_transfer_engine"
        ) as info:
            call()
        assert isinstance(info.value, ConfigError) and isinstance(info.value, RuntimeError)
        assert f"call {instead}"[:5] in str(info.value)
    client.init_weight_transfer_engine([{"rank_offset": 1}, {"rank_offset": 2}])
    sent = len(servers.seen)
    for feature, (call, instead) in calls.items():
        if feature == START_PAUSES:
            continue  # both named it
        with pytest.raises(
            NotAdvertised,
            match=f"{feature}' at init, but http://b:8000 did not name it in its init reply "
            f"\\(stock vLLM never does\\): call {instead}",
        ) as info:
            call()
        assert "http://a:8000" not in str(info.value)
    assert len(servers.seen) == sent  # nothing was sent
    client.pause_and_start("abort")
    assert len(servers.seen) == sent + 2


def test_a_wait_pause_carries_its_bound_only_where_every_server_advertised_it() -> None:
    """``PAUSE_BOUNDS``: a ``wait`` pause (``/pause``, a start's, the round in one request's)
    carries ``wait_s``, this client's timeout less a tenth (0.5 to 30 s), once every server's
    init reply named it; never to a server that did not (stock vLLM), never for other modes."""
    from weightwire.shared.routes import PAUSE_BOUNDS, START_PAUSES, UPDATE_STARTS

    for named, bound in (([], None), ([PAUSE_BOUNDS, START_PAUSES, UPDATE_STARTS], "4.500")):
        servers = Servers({"a": 1})
        servers.responses["a", "/init_weight_transfer_engine"] = httpx.Response(
            200, json={"features": named}
        )
        client = servers.client()  # timeout=5
        client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 2})
        client.pause("wait")
        client.pause("abort")
        if bound is not None:
            client.pause_and_start("wait")
            client.start_update_finish(
                {"names": ["w"]}, "v", pause="wait", reset_caches=True, resume=True
            )
        sent = [q for _, _, p, _, q in servers.seen if p != "/init_weight_transfer_engine"]
        assert [q.get("wait_s") for q in sent] == (
            [None, None] if bound is None else [bound, None, bound, bound]
        ), sent
    assert HTTPWeightSyncClient("http://a:1", timeout=600)._wait_bound("wait") == {}  # not told


def test_a_wait_sleep_carries_the_pause_bound_only_where_every_server_advertised_it() -> None:
    """``PAUSE_BOUNDS`` covers ``/sleep?mode=wait`` too: a sleep that waits for the running
    requests carries the client's ``wait_s``, so one it gave up on never lands later (was: no
    bound, the server drained up to ``--generate-timeout``); never to a server that did not
    name it (stock vLLM's /sleep takes no such field), never for the other modes."""
    from weightwire.shared.routes import PAUSE_BOUNDS

    for named, bound in (([], None), ([PAUSE_BOUNDS], "4.500")):
        servers = Servers({"a": 1})
        servers.responses["a", "/init_weight_transfer_engine"] = httpx.Response(
            200, json={"features": named}
        )
        client = servers.client()  # timeout=5
        client.sleep(1, "wait")  # before the init: /version (a stock one) names nothing
        client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 2})
        client.sleep(1, "wait")
        client.sleep(2, "abort")
        sent = [q for _, _, p, _, q in servers.seen if p == "/sleep"]
        assert sent == [
            {"level": "1", "mode": "wait"},
            {"level": "1", "mode": "wait", **({} if bound is None else {"wait_s": bound})},
            {"level": "2", "mode": "abort"},
        ], sent


def test_a_wait_before_any_init_is_bounded_where_every_servers_version_names_it() -> None:
    """Before any init the client learns ``PAUSE_BOUNDS`` from each server's ``/version`` reply
    (asked once, by the first pause or sleep that waits): a sleep or pause that waits carries
    ``wait_s`` where every server named it, never where one did not (stock vLLM's /version
    names nothing: a mixed set gets no field), and an init's features then take over (was:
    no bound before the init, the server drained up to ``--generate-timeout``)."""
    from weightwire.shared.routes import PAUSE_BOUNDS

    for told, bound in (({"a"}, None), ({"a", "b"}, "4.500")):
        servers = Servers({"a": 1, "b": 1})
        for host in told:
            servers.responses[host, "/version"] = httpx.Response(
                200, json={"version": "0.33.0+weightwire.0.1.0", "features": [PAUSE_BOUNDS]}
            )
        client = servers.client()  # timeout=5
        client.pause("abort")  # no wait: nothing asked
        assert servers.calls("/version") == [] and not client.bounds_pause_waits()
        client.sleep(1, "wait")
        client.pause("wait")
        assert len(servers.calls("/version")) == 2  # once per server, then kept
        assert client.bounds_pause_waits() is (bound is not None)
        client.init_weight_transfer_engine([{"rank_offset": 1}, {"rank_offset": 2}])
        client.sleep(1, "wait")  # the init replies (named nothing here) decide now
        sent = [(p, q.get("wait_s")) for h, _, p, _, q in servers.seen if h == "a"]
        assert sent == [
            ("/pause", None),
            ("/version", None),
            ("/sleep", bound),
            ("/pause", bound),
            ("/init_weight_transfer_engine", None),
            ("/sleep", None),
        ], sent
    servers = Servers({"a": 1})
    servers.responses["a", "/version"] = httpx.Response(503, json={"error": "loading"})
    client = servers.client()
    client.sleep(1, "wait")  # an unanswered /version is not kept: asked again next time
    client.sleep(1, "wait")
    assert len(servers.calls("/version")) == 2


def test_a_callers_shorter_bound_sets_the_wait_pauses_bound() -> None:
    """``bound_waits``: an engine that waits less for a call than the client's request timeout
    (its ``http_s``) gets a ``wait_s`` taken from its bound, less the margin; the shortest of
    several callers' bounds holds; a bound that is no positive finite number is refused."""
    from weightwire.shared.routes import PAUSE_BOUNDS

    servers = Servers({"a": 1})
    servers.responses["a", "/version"] = httpx.Response(
        200, json={"version": "0.33.0+weightwire.0.1.0", "features": [PAUSE_BOUNDS]}
    )
    client = servers.client()  # timeout=5: wait_s 4.5 (a 0.5 s margin)
    client.pause("wait")
    client.bound_waits(3)
    client.pause("wait")
    client.bound_waits(20)  # longer than the first: the first holds
    client.pause("wait")
    sent = [q.get("wait_s") for h, _, p, _, q in servers.seen if p == "/pause"]
    assert sent == ["4.500", "2.500", "2.500"], sent
    for bad in (0, -1, float("inf"), float("nan"), "3"):
        with pytest.raises(ConfigError, match="bound_waits takes a positive finite number"):
            client.bound_waits(bad)  # type: ignore[arg-type]
