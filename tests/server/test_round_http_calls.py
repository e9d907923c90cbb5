"""The HTTP calls of one round against the reference server (``weightwire serve``, one replica,
``weightwire_tcp``), as ``RoundMetrics.http_calls`` counts them: a dense (staged) round is its
start and an update that also commits and resets the caches; a round applied in place is a
start that pauses first and an update that also commits, resets the caches and resumes (the
session's first such round also asks once whether a round guard is installed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.server._server_sender import DRILL_ARGS, running_generation
from weightwire.control import HTTPWeightSyncClient
from weightwire.shared.routes import Route
from weightwire.tools.server.call_clock import HEADER, parse_server_timing


@pytest.fixture(scope="module")
def server(server_factory: Any, tiny_llama: str) -> Any:
    return server_factory(["--model", tiny_llama, *DRILL_ARGS])


class Routes(HTTPWeightSyncClient):
    """Records each HTTP request's route and query, and each reply's Server-Timing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []
        self.timing: dict[str, str | None] = {}
        for path in self._paths:
            path.send = self._timed(path.send)  # type: ignore[method-assign]

    def _timed(self, send: Any) -> Any:
        def timed(route: Route, *args: Any, **kwargs: Any) -> Any:
            response = send(route, *args, **kwargs)
            self.timing[route.name] = response.headers.get(HEADER)
            return response

        return timed

    def _request(
        self, i: int, route: Route, body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        query = "&".join(f"{k}={v}" for k, v in (params or {}).items())
        self.sent.append(route.name + (f"?{query}" if query else ""))
        return super()._request(i, route, body, params)


def rounds(
    url: str | list[str],
    tiny_llama: str,
    timings: dict[str, str | None] | None = None,
    before: Callable[[], object] | None = None,
    accepts: list[bool] | None = None,
    hears: bool = False,
    **info: Any,
) -> list[tuple[int | None, list[str]]]:
    """Two rounds of the checkpoint's tensors: each one's ``http_calls`` and its requests
    (into ``timings``: the last reply's Server-Timing header of each route); ``before``
    runs after the trainer's init, right before the first round. ``hears``: the data path
    hears its workers before it writes (``tests.faults.one_request``: a round may then be
    one request)."""
    timings = {} if timings is None else timings
    from safetensors.torch import load_file

    from weightwire.testing.sources import DictSource
    from weightwire.torch_side.dtypes import wire_name
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer import TrainerInitInfo

    weights = load_file(str(Path(tiny_llama) / "model.safetensors"))
    client = Routes(url, timeout=60)
    engine = TorchTrainerEngine.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp", **info),
        client=client,
        source=DictSource(weights, lambda t: (wire_name(t.dtype), tuple(t.shape))),
    )
    out = []
    if hears:
        from tests.faults.one_request import hearing

        hearing(engine, url if isinstance(url, str) else url[0])
    sender = engine.session.sender
    if accepts is not None and sender is not None:  # each round's Outgoing.go_accepts
        send = sender.send

        def seen(outgoing: Any) -> Any:
            accepts.append(outgoing.go_accepts)
            return send(outgoing)

        sender.send = seen  # type: ignore[method-assign]
    try:
        if before is not None:
            before()
        for _ in range(2):
            client.sent.clear()
            metrics = engine.send_weights()
            out.append((metrics.http_calls, list(client.sent)))
        timings.update(client.timing)
    finally:
        engine.shutdown()
        client.close()
    return out


def test_a_dense_round_is_two_http_calls(server: Any, tiny_llama: str) -> None:
    for calls, sent in rounds(server.url, tiny_llama):
        assert sent == [
            "start_weight_update",
            # the finish (and the caches reset) rides on the update (UPDATE_FINISHES)
            "update_weights?finish=true&reset_caches=true&resume=false",
        ]
        assert calls == len(sent)


def test_a_round_applied_in_place_is_two_http_calls(server: Any, tiny_llama: str) -> None:
    (first_calls, first), (calls, sent) = rounds(server.url, tiny_llama, stage_budget_bytes=0)
    assert sent == [
        "start_weight_update?pause=abort",  # the pause rides on the start
        "update_weights?finish=true&reset_caches=true&resume=true",  # the finish on the update
    ]
    assert calls == 2
    # the session's first round applied in place asks once whether a round guard is installed
    assert first == ["round_guard", "version", *sent] and first_calls == 4


def test_a_round_of_one_server_whose_start_pauses_first_is_accepted_at_the_go(
    server: Any, tiny_llama: str
) -> None:
    """What the data path is told (``Outgoing.go_accepts``): a round applied in place on one
    reference server (its start pauses first) may be written at its workers' go; a staged
    round (no pause, its start sent in line) may not."""
    accepts: list[bool] = []
    rounds(server.url, tiny_llama, accepts=accepts, stage_budget_bytes=0)
    assert accepts == [True, True]
    accepts.clear()
    rounds(server.url, tiny_llama, accepts=accepts)
    assert accepts == [False, False]


def test_two_servers_are_not_accepted_at_a_go_and_keep_their_finish_apart(
    server: Any, server_factory: Any, tiny_llama: str
) -> None:
    """Two reference servers: a go from inside one server's start says nothing of the other's
    (the data path waits for both starts' answers), and the finish stays its own call (one
    server could commit while the other's update failed): never the round in one request,
    even over a data path that hears its workers."""
    other = server_factory(["--model", tiny_llama])
    accepts: list[bool] = []
    done = rounds(
        [server.url, other.url], tiny_llama, accepts=accepts, hears=True, stage_budget_bytes=0
    )
    assert accepts == [False, False]
    for _, sent in done[1:]:
        assert not any("start=true" in call for call in sent)
        assert sent.count("start_weight_update?pause=abort") == 2
        assert sent.count("update_weights") == 2  # one per server, nothing riding on it
        assert sent.count("finish_weight_update") == 2


def test_a_round_over_a_data_path_that_hears_its_workers_is_one_http_call(
    server: Any, tiny_llama: str
) -> None:
    """``UPDATE_STARTS``: where the data path writes nothing before its workers' word from
    inside the round (``weightwire_ipc`` written through), the start rides on the update that
    carries the finish; a staged round (its start does not pause) keeps its two calls."""
    (first_calls, first), (calls, sent) = rounds(
        server.url, tiny_llama, hears=True, stage_budget_bytes=0
    )
    one = "update_weights?start=true&pause=abort&finish=true&reset_caches=true&resume=true"
    assert sent == [one] and calls == 1
    assert first == ["round_guard", "version", one] and first_calls == 3
    for calls, sent in rounds(server.url, tiny_llama, hears=True):
        assert sent[0] == "start_weight_update" and calls == 2


def test_each_round_call_tells_the_server_time_it_took(server: Any, tiny_llama: str) -> None:
    timings: dict[str, str | None] = {}
    rounds(server.url, tiny_llama, timings, stage_budget_bytes=0)
    for route in ("start_weight_update", "update_weights"):
        header = timings[route]
        assert header is not None, f"{route} answered without a Server-Timing header"
        told = parse_server_timing(header)
        # the handler's whole time, and the part of it spent waiting for the worker process
        assert 0 < told["worker"] <= told["app"] < 60, (route, header)
    # the start of a round applied in place paused first, in the same request; its update
    # committed after the workers' update, in the same request
    assert "pause" in parse_server_timing(timings["start_weight_update"] or "")
    assert "commit" in parse_server_timing(timings["update_weights"] or "")
    assert "finish_weight_update" not in timings


def test_a_server_timing_header_is_read_in_seconds_skipping_what_it_cannot_read() -> None:
    told = parse_server_timing("app;dur=1.500, worker;desc=x;dur=0.25, cache;desc=hit, x;dur=y")
    assert told == {"app": 0.0015, "worker": 0.00025}


def test_a_start_that_pauses_with_abort_cancels_a_running_generation(
    server: Any, tiny_llama: str
) -> None:
    """The start's cancel is posted ahead of the start on the worker's pipe (not awaited):
    a generation running when a round applied in place starts still stops at its next step."""
    running: list[tuple[Any, list[Any]]] = []
    # started once the trainer is set up: only the start call lies between it and the cancel
    (_, first), _ = rounds(
        server.url,
        tiny_llama,
        before=lambda: running.append(running_generation(server.url)),
        stage_budget_bytes=0,
    )
    assert "start_weight_update?pause=abort" in first
    ((t, out),) = running
    t.join(60)
    assert out and out[0].status_code == 200, out
    choice = out[0].json()["choices"][0]
    assert choice["finish_reason"] == "abort" and out[0].json()["usage"]["completion_tokens"] < 240
