"""The reference server's ``/abort_requests`` and ``/start_draft_weight_update``, driven
through ``HTTPWeightSyncClient`` (the calls a trainer makes)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server._server_sender import DRILL_ARGS, released, running_generation
from weightwire.control import HTTPWeightSyncClient
from weightwire.shared.errors import WeightSyncError


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama: str):
    return server_factory(["--model", tiny_llama, "--replicas", "1", *DRILL_ARGS])


@pytest.fixture(scope="module")
def client(server) -> Iterator[HTTPWeightSyncClient]:
    with HTTPWeightSyncClient(server.url, timeout=60) as c:
        yield c


def test_abort_requests_stops_a_running_generation_without_pausing(
    server, client: HTTPWeightSyncClient
) -> None:
    t, out = running_generation(server.url)
    assert client.abort_requests() == [{"status": "aborted", "aborted": 1}]
    t.join(60)
    assert out and out[0].status_code == 200, out
    choice = out[0].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and out[0].json()["usage"]["completion_tokens"] < 240
    assert client.is_paused() == [False]  # abort is not a pause: the next request runs
    short = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    again = httpx.post(server.url + "/v1/completions", json=short, timeout=60)
    assert again.json()["choices"][0]["finish_reason"] == "length"


def test_abort_requests_with_nothing_in_flight_and_bad_bodies(
    server, client: HTTPWeightSyncClient
) -> None:
    assert client.abort_requests() == [{"status": "aborted", "aborted": 0}]
    with pytest.raises(
        WeightSyncError, match=r"abort_requests failed .*400.*aborts all in-flight requests at once"
    ):
        client.abort_requests(["cmpl-1"])
    with pytest.raises(TypeError, match="request_ids must be a list"):
        client.abort_requests("cmpl-1")  # type: ignore[arg-type]
    r = httpx.post(server.url + "/abort_requests", json={"ids": []})
    assert r.status_code == 422 and "unknown field(s) ['ids']" in r.text


def test_draft_round_is_refused_with_the_reason(client: HTTPWeightSyncClient) -> None:
    assert client.has_draft_model() == [False]  # what a trainer engine asks before a draft round
    with pytest.raises(
        WeightSyncError,
        match=r"start_draft_weight_update failed .*400.*no speculative-decoding draft",
    ):
        client.start_draft_weight_update()


def _still_running(out: list[httpx.Response]) -> None:
    assert not out, "the generation ended before the bound: the case tests nothing"


def test_a_wait_pause_past_its_clients_bound_is_504_and_undone_never_taking_effect_later(
    server,
) -> None:
    """``PAUSE_BOUNDS``: ``/pause?mode=wait&wait_s=`` and a start's ``pause=wait&wait_s=`` stop
    draining at the client's bound (below ``--generate-timeout``), answer 504 and undo the
    pause they took: once the generation ends the server is still not paused and the session
    has no round (was: the drain waited up to --generate-timeout, past the client, and then
    paused, or opened the round, for a caller that was told it failed)."""
    from tests.server._server_sender import TCPSender, VLLMStyleClient

    http = httpx.Client(base_url=server.url, timeout=30)
    t, out = running_generation(server.url)
    resp = http.post("/pause", params={"mode": "wait", "wait_s": "0.2"})
    _still_running(out)
    assert resp.status_code == 504, resp.text
    assert "still running after 0.2 s (mode=wait); the pause was undone" in resp.text
    assert http.get("/is_paused").json() == {"is_paused": False}
    sender = TCPSender(VLLMStyleClient(server.url), replicas=1)
    try:
        sender.init()
        resp = http.post("/start_weight_update", params={"pause": "wait", "wait_s": "0.2"})
        _still_running(out)
        assert resp.status_code == 504, resp.text
        assert "the pause this start took was undone" in resp.text, resp.text
        # ended now (an abort) rather than at its 240th token: its end is what the undone
        # pause / sleep must not ride on, however it comes
        assert released(server.url, t, out).status_code == 200
        assert http.get("/is_paused").json() == {"is_paused": False}
        assert http.get("/weight_info").json()["session"]["state"] == "ready"
        for params, word in (
            ({"mode": "abort", "wait_s": "1"}, "give it with mode=wait"),
            ({"mode": "wait", "wait_s": "0"}, "wait_s must be a positive number"),
            ({"mode": "wait", "wait_s": "nan"}, "wait_s must be a positive number"),
        ):
            resp = http.post("/pause", params=params)
            assert resp.status_code == 422 and word in resp.text, resp.text
        resp = http.post("/start_weight_update", params={"wait_s": "1"})
        assert resp.status_code == 422 and "give it with pause=wait" in resp.text, resp.text
        assert http.get("/is_paused").json() == {"is_paused": False}
    finally:
        sender.close()
        http.close()


def test_a_wait_sleep_past_its_clients_bound_is_504_and_undone_never_sleeping_later(
    server,
) -> None:
    """``PAUSE_BOUNDS`` on ``/sleep?mode=wait&wait_s=``: the drain stops at the client's bound
    (below ``--generate-timeout``), the sleep answers 504 saying the server did not sleep, and
    once the generation ends the server is still awake and generating (was: the drain waited
    up to --generate-timeout, past the client, and then slept, for a caller told it failed)."""
    http = httpx.Client(base_url=server.url, timeout=30)
    try:
        t, out = running_generation(server.url)
        resp = http.post("/sleep", params={"level": "1", "mode": "wait", "wait_s": "0.2"})
        _still_running(out)
        assert resp.status_code == 504, resp.text
        assert "sleep failed: 1 request(s) still running after 0.2 s (mode=wait)" in resp.text
        assert "the server did not sleep" in resp.text, resp.text
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        # ended now (an abort) rather than at its 240th token: its end is what the undone
        # pause / sleep must not ride on, however it comes
        assert released(server.url, t, out).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.get("/is_paused").json() == {"is_paused": False}
        short = {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True, "temperature": 0}
        assert http.post("/v1/completions", json=short).status_code == 200  # not held
        resp = http.post("/sleep", params={"level": "1", "mode": "abort", "wait_s": "1"})
        assert resp.status_code == 422 and "give it with mode=wait" in resp.text, resp.text
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    finally:
        http.close()


def test_a_wait_sleep_before_any_init_is_bounded_by_its_client_and_never_sleeps_later(
    server,
) -> None:
    """A client that never ran an init (a sleep between jobs) learns ``pause_bounds`` from
    the server's ``/version``: its ``sleep(mode="wait")`` carries ``wait_s`` (its timeout 2 s
    less 0.5), so the server answers 504 "did not sleep" before the client gives up, and once
    the generation ends the server is still awake (was: no ``wait_s`` before an init, the
    drain ran to ``--generate-timeout``, the client gave up with no answer, and the server
    slept later, for a caller told it failed)."""
    t, out = running_generation(server.url)
    try:
        with HTTPWeightSyncClient(server.url, timeout=2) as fresh:
            with pytest.raises(WeightSyncError, match="the server did not sleep") as info:
                fresh.sleep(1, "wait")
            _still_running(out)
            assert info.value.status == 504, info.value
            assert "still running after 1.5 s (mode=wait)" in info.value.message
            assert fresh.is_sleeping() == [False]
    finally:
        t.join(60)
    assert out and out[0].status_code == 200
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.get("/is_paused").json() == {"is_paused": False}
