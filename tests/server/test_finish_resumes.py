"""The reference server's start that pauses first, finish that also resets the caches and
resumes, update that also commits, and update that also starts: the round in one request
(all advertised at init).

Over the real app (``create_app``) with an in-process pool whose receiver answers at once:
the init reply names the feature; ``?reset_caches=true&resume=true`` resumes generation only
after a commit (a finish that closed an empty round leaves the pause alone); an asleep server
commits but says why it did not resume; bad flags are 422 before anything is done; and the
client uses it only where every server named it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from weightwire.backends.tcp.spec import TCP
from weightwire.control.client import HTTPWeightSyncClient, NotAdvertised
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.info import encode_secret
from weightwire.shared.routes import (
    FINISH_RESETS_RESUMES,
    PAUSE_BOUNDS,
    START_PAUSES,
    UPDATE_FINISHES,
    UPDATE_STARTS,
    start_left_paused,
)
from weightwire.tools.bench.sync_http import InProcessPool
from weightwire.tools.server.app import ServerOptions, ServerState, create_app

INIT = {
    "host": "127.0.0.1",
    "port": 1,
    "secret_b64": encode_secret(b"s" * 128),
    "rank_offset": 1,
    "world_size": 2,
}
THEN = {"reset_caches": "true", "resume": "true"}
LISTED = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[1]]}
"""An update info that lists a tensor (the receiver takes any): empty lists, "the previous
round's", are refused where a session listed none."""


class Instant:
    """A receiver that answers every op at once (``fails``: the op it fails, naming it)."""

    def __init__(self, fails: str | None = None) -> None:
        self.fails = fails
        self.ops: list[str] = []

    async def call(self, op: str, args: dict[str, Any]) -> Any:
        self.ops.append(op)
        if op == self.fails:
            raise RuntimeError(f"the worker's {op} failed")
        return {"tensors": 0} if op == "update" else None

    def abort(self) -> None:
        return None


@pytest.fixture
def served() -> Iterator[tuple[ServerState, TestClient]]:
    state = ServerState(
        pool=InProcessPool(Instant()),  # type: ignore[arg-type]
        options=ServerOptions(backend=TCP.name),
    )
    with TestClient(create_app(state)) as http:
        yield state, http


def client_for(http: TestClient) -> HTTPWeightSyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        r = http.request(
            request.method,
            request.url.raw_path.decode(),
            content=request.content,
            headers=dict(request.headers),
        )
        return httpx.Response(r.status_code, content=r.content, headers=r.headers)

    return HTTPWeightSyncClient("http://ref:1", timeout=10, transport=httpx.MockTransport(handler))


def test_init_names_the_feature_and_a_committed_finish_resets_and_resumes(served: Any) -> None:
    state, http = served
    reply = http.post("/init_weight_transfer_engine", json={"init_info": INIT}).json()
    assert reply["features"] == [
        START_PAUSES,
        FINISH_RESETS_RESUMES,
        UPDATE_FINISHES,
        UPDATE_STARTS,
        PAUSE_BOUNDS,
    ]
    http.post("/pause", params={"mode": "abort"})
    http.post("/start_weight_update")
    http.post("/update_weights", json={"update_info": LISTED})
    assert state.gate.paused
    r = http.post("/finish_weight_update", params=THEN, json={"weight_version": "v1"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "message": "Weight update finished",
        "weight_version": "v1",
        "caches_reset": True,
        "resumed": True,
    }
    assert not state.gate.paused


def test_a_finish_that_committed_nothing_resumes_nothing(served: Any) -> None:
    state, http = served
    http.post("/init_weight_transfer_engine", json={"init_info": INIT})
    http.post("/pause", params={"mode": "abort"})
    http.post("/start_weight_update")
    r = http.post("/finish_weight_update", params=THEN, json={"weight_version": "v1"})
    assert r.status_code == 409 and "no weights were sent in this round" in r.text
    assert state.gate.paused  # the trainer's own rule for a failed round decides


def test_bad_flags_are_refused_before_the_finish(served: Any) -> None:
    state, http = served
    http.post("/init_weight_transfer_engine", json={"init_info": INIT})
    http.post("/start_weight_update")
    http.post("/update_weights", json={"update_info": LISTED})
    r = http.post("/finish_weight_update", params={"resume": "soon"}, json={"weight_version": "v"})
    assert r.status_code == 422 and "query parameter resume must be true or false" in r.text
    assert state.session.weight_version != "v"  # nothing committed
    assert http.post("/finish_weight_update", json={"weight_version": "v"}).status_code == 200


def test_an_asleep_server_commits_lifts_the_rounds_pause_and_its_sleep_holds(
    served: Any,
) -> None:
    """A finish asked to resume while ``/sleep`` holds the server commits and lifts the
    round's pause; generation stays held by the sleep until ``/wake_up`` (was: the resume was
    refused, the committed round raised, and the round's pause outlived the wake that the
    error said would resume generation)."""
    state, http = served
    client = client_for(http)
    client.init_weight_transfer_engine(INIT)
    assert client.finishes_with_resume()
    client.pause("abort")
    client.start_weight_update()
    client.update_weights(LISTED)
    r = http.post("/sleep", params={"level": 0})  # a round is open: refused
    assert r.status_code == 409, r.text
    state.sleep.level = 0  # as a /sleep?level=0 that landed (it holds generation)
    state.gate.hold_for_sleep("abort")
    client.finish_reset_resume("v2")  # no resume refused: nothing raised
    client.pause("abort")
    client.start_weight_update()
    client.update_weights(LISTED)
    r = http.post("/finish_weight_update", params=THEN, json={"weight_version": "v2"})
    reply = r.json()
    assert reply["resumed"] is True and "until POST /wake_up" in reply["held_by_sleep"]
    assert state.session.weight_version == "v2" and state.gate.mode is None  # committed
    assert state.gate.paused  # by the sleep's own hold
    resumed = http.post("/resume")  # asleep: it would not resume generation
    assert resumed.status_code == 503 and "(that resumes generation)" in resumed.text
    client.pause("keep")  # a /pause outlives the wake: the refusal names both steps
    resumed = http.post("/resume")
    assert resumed.status_code == 503, resumed.text
    assert "then POST /resume again to lift the /pause (mode=keep)" in resumed.text


def test_the_client_asks_only_where_every_server_named_it() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/init_weight_transfer_engine":
            named = [FINISH_RESETS_RESUMES] if request.url.host == "a" else []
            return httpx.Response(200, json={"session_id": "s", "features": named})
        return httpx.Response(200, json={})

    both = HTTPWeightSyncClient(
        ["http://a:1", "http://b:1"], transport=httpx.MockTransport(handler)
    )
    assert not both.finishes_with_resume()  # before init: nothing named
    both.init_weight_transfer_engine([INIT, INIT])
    assert not both.finishes_with_resume()  # b (a stock vLLM, say) names nothing
    with pytest.raises(NotAdvertised, match="http://b:1 did not name it") as info:
        both.finish_reset_resume("v")
    assert isinstance(info.value, RuntimeError) and "http://a:1" not in str(info.value)
    one = HTTPWeightSyncClient("http://a:1", transport=httpx.MockTransport(handler))
    one.init_weight_transfer_engine(INIT)
    assert one.finishes_with_resume()


def test_a_start_that_pauses_holds_generation_then_starts(served: Any) -> None:
    state, http = served
    client = client_for(http)
    client.init_weight_transfer_engine(INIT)
    assert client.starts_with_pause() and not state.gate.paused
    client.pause_and_start("abort")
    assert state.gate.paused and state.gate.mode == "abort"
    assert http.post("/start_weight_update").status_code == 409  # the round is open


def test_a_refused_start_pauses_nothing_and_a_bad_mode_is_422(served: Any) -> None:
    state, http = served
    r = http.post("/start_weight_update", params={"pause": "keep"})  # no init: refused
    assert r.status_code == 409 and not state.gate.paused
    assert "this start paused nothing" in r.json()["error"]["message"]  # for a person
    assert r.json()["error"]["pause"] == "none"  # what the trainer reads (start_left_paused)
    r = http.post("/start_weight_update")  # a start without a pause says nothing of one
    assert r.status_code == 409 and "pause" not in r.json()["error"]
    http.post("/init_weight_transfer_engine", json={"init_info": INIT})
    r = http.post("/start_weight_update", params={"pause": "soon"})
    assert r.status_code == 422 and "pause must be one of" in r.text
    assert not state.gate.paused and state.session.phase.name != "ROUND"


def _serve(receiver: Instant) -> Any:
    state = ServerState(
        pool=InProcessPool(receiver),  # type: ignore[arg-type]
        options=ServerOptions(backend=TCP.name),
    )
    return state, TestClient(create_app(state))


def test_an_update_that_finishes_commits_resets_and_resumes_in_one_request() -> None:
    receiver = Instant()
    state, http = _serve(receiver)
    with http:
        client = client_for(http)
        client.init_weight_transfer_engine(INIT)
        assert client.updates_with_finish()
        client.pause_and_start("abort")
        assert state.gate.paused
        (reply,) = client.update_and_finish(LISTED, "v1", reset_caches=True, resume=True)
        assert reply["weight_version"] == "v1" and reply["caches_reset"] is True
        assert reply["resumed"] is True and reply["replicas"] == [{"tensors": 0}]
        assert receiver.ops[-2:] == ["update", "finish"]  # committed after the update held
        assert state.session.weight_version == "v1" and not state.gate.paused
        assert state.session.describe()["state"] != "round_active"
        # an unpaused round's: the resets, no resume
        client.start_weight_update()
        (reply,) = client.update_and_finish(LISTED, None, reset_caches=True, resume=False)
        assert reply["weight_version"] == "v1" and "resumed" not in reply


def test_a_failed_update_commits_nothing_and_a_failed_commit_fails_as_a_finish() -> None:
    for fails, route in (("update", "update_weights"), ("finish", "finish_weight_update")):
        receiver = Instant(fails)
        state, http = _serve(receiver)
        with http:
            client = client_for(http)
            client.init_weight_transfer_engine(INIT)
            client.pause_and_start("abort")
            with pytest.raises(WeightSyncError, match=f"the worker's {fails} failed") as caught:
                client.update_and_finish(LISTED, "v1", reset_caches=True, resume=True)
            assert caught.value.route == route  # what failed, whichever request carried it
            if fails == "update":
                assert "finish" not in receiver.ops  # nothing committed after a failed update
            assert state.session.weight_version != "v1" and state.gate.paused  # held
            assert "start a new session" in caught.value.message


def test_a_finishs_flags_without_finish_and_bad_flags_are_refused_before_the_update() -> None:
    receiver = Instant()
    _, http = _serve(receiver)
    with http:
        http.post("/init_weight_transfer_engine", json={"init_info": INIT})
        http.post("/start_weight_update")
        body = {"update_info": LISTED, "weight_version": "v"}
        for params, says in (
            ({"resume": "true"}, "query parameter resume is a finish's: give finish=true"),
            ({"finish": "soon"}, "query parameter finish must be true or false"),
            ({"finish": "true", "resume": "x"}, "query parameter resume must be true or false"),
        ):
            r = http.post("/update_weights", params=params, json=body)
            assert r.status_code == 422 and says in r.text, r.text
        # a plain update takes no weight_version
        assert http.post("/update_weights", json=body).status_code == 422
        assert "update" not in receiver.ops


def test_a_flag_given_twice_is_refused_before_anything_is_done() -> None:
    """A round's query flag given twice (``pause=abort&pause=keep``, ``finish=true&finish=
    false``, ``resume=true&resume=false``, ``start=true&start=false``) is a 422 naming it,
    before the request does anything (was: the last one silently held, so ``finish=true&
    finish=false`` was a plain update and the round stayed open uncommitted)."""
    receiver = Instant()
    state, http = _serve(receiver)
    with http:
        http.post("/init_weight_transfer_engine", json={"init_info": INIT})
        r = http.post("/start_weight_update", params=[("pause", "abort"), ("pause", "keep")])
        assert r.status_code == 422 and "pause is given 2 times" in r.text, r.text
        assert not state.gate.paused and "start" not in receiver.ops
        assert http.post("/start_weight_update").status_code == 200
        body = {"update_info": LISTED, "weight_version": "v"}
        for params in (
            [("finish", "true"), ("finish", "false")],
            [("finish", "true"), ("resume", "true"), ("resume", "false")],
            [("finish", "true"), ("reset_caches", "1"), ("reset_caches", "0")],
            # was: the last start held, so this one committed the open round as a plain
            # update that finishes (and start=false&start=true opened one)
            [("start", "true"), ("start", "false"), ("finish", "true")],
            [("start", "false"), ("start", "true"), ("finish", "true")],
        ):
            r = http.post("/update_weights", params=params, json=body)
            assert r.status_code == 422 and "is given 2 times" in r.text, r.text
            assert "give it once" in r.json()["error"]["message"]
        assert "update" not in receiver.ops
        r = http.post("/finish_weight_update", params=[("resume", "1"), ("resume", "0")])
        assert r.status_code == 422 and "resume is given 2 times" in r.text, r.text
        assert state.session.phase.name == "ROUND"  # nothing above touched the open round
        r = http.post("/update_weights", params={"finish": "true"}, json=body)
        assert r.status_code == 200 and state.session.weight_version == "v", r.text


def test_pause_and_sleep_flags_given_twice_are_refused_before_anything_is_done() -> None:
    """``/pause?mode=`` and ``/sleep?level=`` (and their other flags) given twice are a 422
    naming the flag, before anything is paused or put to sleep, as the round's flags are (was:
    the last one held, so ``level=1&level=2`` discarded the weights)."""
    receiver = Instant()
    state, http = _serve(receiver)
    with http:
        for route, params, flag in (
            ("/pause", [("mode", "keep"), ("mode", "abort")], "mode"),
            ("/pause", [("clear_cache", "true"), ("clear_cache", "false")], "clear_cache"),
            ("/sleep", [("level", "1"), ("level", "2")], "level"),
            ("/sleep", [("level", "1"), ("mode", "wait"), ("mode", "keep")], "mode"),
        ):
            r = http.post(route, params=params)
            assert r.status_code == 422, (route, r.text)
            error = r.json()["error"]
            assert error["param"] == flag and f"{flag} is given 2 times" in error["message"]
            assert not state.gate.paused and state.sleep.level is None, route
        assert receiver.ops == []
        assert http.post("/sleep", params={"level": "1"}).json() == {
            "status": "sleeping",
            "level": 1,
        }


def _until(cond: Any, bound_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("second_starts", [False, True], ids=["after", "meanwhile"])
def test_a_start_whose_pause_waited_while_a_newer_init_replaced_its_session_opens_nothing(
    second_starts: bool,
) -> None:
    """``start?pause=wait`` waits for the running requests; a second trainer's init lands
    meanwhile (no round is open yet). The first start must not then open a round in the new
    session (whose own start would be refused 409 until the round lease): refused naming the
    replacement, no worker started by it, the pause it took undone; the new trainer's start
    goes, after it or meanwhile (then its own pause stays: its round is in place)."""
    import threading

    from weightwire.shared.routes import SESSION_HEADER

    receiver = Instant()
    state, http = _serve(receiver)
    with http:
        first = http.post("/init_weight_transfer_engine", json={"init_info": INIT}).json()
        http.portal.call(state.gate.enter)  # a request running: the wait-mode pause drains it
        answer: list[Any] = []
        starting = threading.Thread(
            target=lambda: answer.append(
                http.post(
                    "/start_weight_update",
                    params={"pause": "wait"},
                    headers={SESSION_HEADER: first["session_id"]},
                )
            )
        )
        starting.start()
        _until(lambda: state.gate.mode == "wait")  # the start is draining
        second = http.post("/init_weight_transfer_engine", json={"init_info": INIT}).json()
        assert second["session_id"] != first["session_id"]
        own = {SESSION_HEADER: second["session_id"]}
        if second_starts:
            r = http.post("/start_weight_update", params={"pause": "abort"}, headers=own)
            assert r.status_code == 200 and receiver.ops.count("start") == 1, r.text
        http.portal.call(state.gate.leave)  # the running request ends: the drain returns
        starting.join(10)
        (refused,) = answer
        assert refused.status_code == 409, refused.text
        assert "replaced this trainer's session while its start waited" in refused.text
        if second_starts:  # the new session's round and pause stand
            assert state.session.phase.name == "ROUND" and state.gate.mode == "abort"
            assert receiver.ops.count("start") == 1
            return
        assert state.session.phase.name != "ROUND" and not state.gate.paused
        assert "the pause this start took was undone" in refused.text
        assert refused.json()["error"]["pause"] == "undone"
        assert "start" not in receiver.ops  # no worker started
        r = http.post("/start_weight_update", headers=own)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("one_request", [False, True], ids=["start", "one_request"])
def test_a_start_whose_pause_waited_while_a_sleep_put_the_weights_away_opens_nothing(
    one_request: bool,
) -> None:
    """``pause=wait`` waits for the running requests; a ``/sleep?level=1`` lands meanwhile
    (no round is open yet, so it is not refused) and puts the weights away. The start is
    refused as an asleep server's start is at its first check: 409 saying so, its pause
    undone, no worker started, the session kept (was: its workers were asked to start, which
    a real worker refuses while asleep: a 5xx that failed the trainer's session)."""
    import threading

    from weightwire.shared.routes import SESSION_HEADER

    receiver = Instant()
    state, http = _serve(receiver)
    with http:
        sid = http.post("/init_weight_transfer_engine", json={"init_info": INIT}).json()
        own = {SESSION_HEADER: sid["session_id"]}
        route, params, body = "/start_weight_update", {"pause": "wait"}, None
        if one_request:
            route, params = "/update_weights", {**ONE, "pause": "wait"}
            body = {"update_info": LISTED, "weight_version": "v"}
        http.portal.call(state.gate.enter)  # a request running: the wait-mode pause drains it
        answer: list[Any] = []
        starting = threading.Thread(
            target=lambda: answer.append(http.post(route, params=params, json=body, headers=own))
        )
        starting.start()
        _until(lambda: state.gate.mode == "wait")  # the start is draining
        r = http.post("/sleep", params={"level": 1, "mode": "keep"})
        assert r.status_code == 200 and state.sleep.weights_asleep, r.text
        http.portal.call(state.gate.leave)  # the running request ends: the drain returns
        starting.join(10)
        (refused,) = answer
        assert refused.status_code == 409, refused.text
        assert "start_weight_update refused: the server is asleep (/sleep level 1)" in (
            refused.text
        )
        assert refused.json()["error"]["pause"] == "undone"
        assert state.gate.mode is None and "start" not in receiver.ops
        assert state.session.session_id == sid["session_id"] and state.session.rounds_failed == 0
        state.sleep.weights_asleep, state.sleep.level = False, None  # (this receiver never wakes)
        state.gate.hold_for_sleep(None)
        r = http.post("/start_weight_update", params={"pause": "abort"}, headers=own)
        assert r.status_code == 200, r.text


def test_a_start_whose_wait_pause_timed_out_started_nothing_and_undid_its_pause() -> None:
    """``start?pause=wait`` whose running requests outlast the generate timeout: 504 before
    any worker started, so the pause it took is undone (the trainer's round failed before
    its start opened anything); a pause held before it stays."""
    from weightwire.tools.server.app import ServerOptions

    receiver = Instant()
    state = ServerState(
        pool=InProcessPool(receiver),  # type: ignore[arg-type]
        options=ServerOptions(backend=TCP.name, generate_timeout_s=0.05),
    )
    with TestClient(create_app(state)) as http:
        client = client_for(http)
        client.init_weight_transfer_engine(INIT)
        http.portal.call(state.gate.enter)  # a request that outlasts the timeout
        for held in (None, "abort"):
            if held is not None:
                http.post("/pause", params={"mode": held})
            with pytest.raises(WeightSyncError) as refused:
                client.pause_and_start("wait")
            assert refused.value.status == 504 and "still running" in refused.value.message
            assert refused.value.pause == ("undone" if held is None else "held")
            assert start_left_paused(refused.value.pause) is (held is not None)
            assert "the pause this start took was undone" in refused.value.message
            assert state.gate.mode == held and state.session.phase.name != "ROUND"
            assert "start" not in receiver.ops


# -- the round in one request (UPDATE_STARTS) ------------------------------------------------

ONE = {"start": "true", "pause": "abort", "finish": "true", **THEN}


def test_the_round_in_one_request_starts_pauses_updates_commits_and_resumes() -> None:
    receiver = Instant()
    state, http = _serve(receiver)
    with http:
        client = client_for(http)
        client.init_weight_transfer_engine(INIT)
        assert client.updates_with_start()
        (reply,) = client.start_update_finish(
            LISTED, "v1", pause="abort", reset_caches=True, resume=True
        )
        assert reply["message"] == "Weight update started, weights updated and finished"
        assert reply["weight_version"] == "v1" and reply["resumed"] and reply["caches_reset"]
        # the start's cancel, its workers' start, the update, the commit: in that order
        assert receiver.ops[-3:] == ["start", "update", "finish"]
        assert state.session.describe()["state"] != "round_active" and not state.gate.paused
        assert state.session.rounds_committed == 1
        # without a pause the start pauses nothing (a staged round's shape)
        (reply,) = client.start_update_finish(
            LISTED, "v2", pause=None, reset_caches=True, resume=False
        )
        assert reply["weight_version"] == "v2" and "resumed" not in reply


def test_the_round_in_one_request_is_refused_before_its_pause_naming_the_start() -> None:
    """Every check that can refuse (a bad flag, the caller's session, a round already open,
    sleep, the version, the update info) runs before the start's pause and before any worker
    starts; the refusal names ``start_weight_update`` and the session lives on."""
    from weightwire.shared.routes import SESSION_HEADER

    receiver = Instant()
    state, http = _serve(receiver)
    with http:
        sid = http.post("/init_weight_transfer_engine", json={"init_info": INIT}).json()
        own = {SESSION_HEADER: sid["session_id"]}
        body = {"update_info": LISTED, "weight_version": "v"}
        for params, says in (
            ({"start": "true", "pause": "abort"}, "start=true needs finish=true"),
            ({"pause": "abort", "finish": "true"}, "query parameter pause is a start's"),
            ({**ONE, "pause": "soon"}, "pause must be one of"),
            ({**ONE, "start": "maybe"}, "query parameter start must be true or false"),
        ):
            r = http.post("/update_weights", params=params, json=body, headers=own)
            assert r.status_code == 422 and says in r.text, r.text
        refusals: list[tuple[dict[str, Any], dict[str, str], int, str]] = [
            (body, {SESSION_HEADER: "another"}, 409, "was replaced by a newer"),
            ({**body, "weight_version": "v" * 5000}, own, 422, "weight_version must be"),
            ({"update_info": {"names": [1]}, "weight_version": "v"}, own, 422, "update's"),
        ]
        for sent, headers, status, says in refusals:
            r = http.post("/update_weights", params=ONE, json=sent, headers=headers)
            assert r.status_code == status and says in r.text, r.text
            assert "start_weight_update refused" in r.text
        state.sleep.weights_asleep, state.sleep.level = True, 1
        r = http.post("/update_weights", params=ONE, json=body, headers=own)
        assert r.status_code == 409 and "start_weight_update refused: the server is asleep" in (
            r.text
        )
        state.sleep.weights_asleep, state.sleep.level = False, None
        assert receiver.ops.count("start") == 0 and "update" not in receiver.ops
        assert not state.gate.paused and state.session.session_id == sid["session_id"]
        assert state.session.rounds_failed == 0
        http.post("/start_weight_update", headers=own)  # a round already open
        r = http.post("/update_weights", params=ONE, json=body, headers=own)
        assert r.status_code == 409 and "start_weight_update refused: a weight update is" in (
            r.text
        )
        assert receiver.ops.count("start") == 1 and not state.gate.paused


@pytest.mark.parametrize(
    ("fails", "route"),
    [
        ("start", "start_weight_update"),
        ("update", "update_weights"),
        ("finish", "finish_weight_update"),
    ],
)
def test_a_step_failing_inside_the_one_request_is_named_and_commits_nothing(
    fails: str, route: str
) -> None:
    receiver = Instant(fails)
    state, http = _serve(receiver)
    with http:
        client = client_for(http)
        client.init_weight_transfer_engine(INIT)
        with pytest.raises(WeightSyncError, match=f"the worker's {fails} failed") as caught:
            client.start_update_finish(LISTED, "v1", pause="abort", reset_caches=True, resume=True)
        assert caught.value.route == route  # the step that failed, inside the one request
        assert caught.value.status is not None and caught.value.status >= 500
        steps = ["start", "update", "finish"]
        # none after it; where an update or finish failed, the server asks the replica
        # whether its model holds part of the round (``weights``: it writes nothing)
        ops = [op for op in receiver.ops if op != "weights"]
        assert ops[ops.index("start") :] == steps[: steps.index(fails) + 1]
        assert state.session.weight_version != "v1" and state.gate.paused  # held, not resumed
        assert state.session.session_id is None  # the session failed: a new init is needed


def test_a_round_in_one_request_whose_wait_pause_a_newer_init_outlived_opens_nothing() -> None:
    """The one request's start waits in its ``wait`` pause; a second trainer's init replaces
    the session meanwhile: the request is refused naming the start and the replacement, no
    worker started or updated, its pause undone, the new session untouched."""
    import threading

    from weightwire.shared.routes import SESSION_HEADER

    receiver = Instant()
    state, http = _serve(receiver)
    with http:
        first = http.post("/init_weight_transfer_engine", json={"init_info": INIT}).json()
        http.portal.call(state.gate.enter)  # a request running: the wait-mode pause drains it
        answer: list[Any] = []
        body = {"update_info": LISTED, "weight_version": "v1"}
        sending = threading.Thread(
            target=lambda: answer.append(
                http.post(
                    "/update_weights",
                    params={**ONE, "pause": "wait"},
                    json=body,
                    headers={SESSION_HEADER: first["session_id"]},
                )
            )
        )
        sending.start()
        _until(lambda: state.gate.mode == "wait")  # the request's start is draining
        second = http.post("/init_weight_transfer_engine", json={"init_info": INIT}).json()
        http.portal.call(state.gate.leave)  # the running request ends: the drain returns
        sending.join(10)
        (refused,) = answer
        assert refused.status_code == 409, refused.text
        assert "start_weight_update refused: a newer /init_weight_transfer_engine" in refused.text
        assert "start" not in receiver.ops and "update" not in receiver.ops
        assert not state.gate.paused and state.session.session_id == second["session_id"]
        assert state.session.weight_version != "v1"
