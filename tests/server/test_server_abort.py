"""The reference server's ``/abort_requests`` and ``/start_draft_weight_update``, driven
through ``HTTPWeightSyncClient`` (the calls a trainer makes)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.server._server_sender import running_generation
from weightwire.control import HTTPWeightSyncClient
from weightwire.shared.errors import WeightSyncError


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama: str):
    return server_factory(["--model", tiny_llama, "--replicas", "1"])


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
