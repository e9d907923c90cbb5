"""Sleep, takeover and version faults against a real reference server: what the server
reports and what its workers do agree, and an operation reported as failed never takes
effect later.

Own server (tiny-llama, ``--op-timeout 1`` so a sleep blocked by a generation gives up
fast, a decode step delay (``HOLD_ARGS``) so that generation holds the model on any machine,
``--round-lease 20`` so a round held open on purpose outlives the probe's calls,
``--log-level info`` for the round log lines).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.harness import (
    AUTH,
    HOLD_ARGS,
    Probe,
    TensorSource,
    assert_weights,
    client_for,
    elapsed,
    engine_for,
    load_weights,
    observe,
    quiet_shutdown,
)
from tests.faults.servers import Server, serving
from tests.server._server_sender import released, running_generation
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.routes import SESSION_HEADER

pytestmark = pytest.mark.timeout(180)
OP_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from weightwire.tools.server.tiny import tiny_model_dir

    return Path(tiny_model_dir("tiny-llama"))


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(
        tiny_dir,
        tmp_path_factory.mktemp("sleep-faults"),
        "--op-timeout",
        str(OP_TIMEOUT_S),
        "--round-lease",
        "20",
        "--log-level",
        "info",
        *HOLD_ARGS,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def probe(server: Server) -> Iterator[Probe]:
    p = Probe(server.url)
    yield p
    p.close()


@pytest.fixture()
def tiny_source(tiny_dir: Path) -> TensorSource:
    return TensorSource(load_weights(tiny_dir))


def _completion(http: httpx.Client, **extra: Any) -> httpx.Response:
    return http.post(
        "/v1/completions",
        json={
            "prompt": "The trainer sends",
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        },
    )


def _error(resp: httpx.Response) -> str:
    body = resp.json()
    return f"{resp.status_code} {body['error']['message'] if 'error' in body else body}"


def _awake(probe: Probe) -> None:
    """Every case leaves the server awake, unpaused, with no engine."""
    probe.http.post("/wake_up")
    probe.http.post("/resume")
    probe.http.post("/shutdown_weight_transfer_engine")


def test_sleep_that_timed_out_never_happens_later(server: Server, probe: Probe) -> None:
    """A /sleep?level=2 blocked by a generation answers 504 after its op timeout, while the
    generation still runs, and, having said "did not sleep", never sleeps when the
    generation ends: the weights, version and serving stay as before."""
    before, version = probe.checksums()[0], probe.version()
    running = running_generation(server.url, AUTH)
    try:
        with elapsed() as t:
            resp = probe.http.post("/sleep", params={"level": 2, "mode": "keep"})
        answered_first = running[0].is_alive()  # the verdict did not wait for the generation
        during = probe.http.get("/is_sleeping").json()
    finally:
        generation = released(server.url, *running, AUTH)
    assert generation.status_code == 200, generation.text
    observe(server=_error(resp), server_s=t[0])
    assert resp.status_code == 504 and during == {"is_sleeping": False}, resp.text
    # The generation is over and the model lock free: nothing may have slept since.
    assert probe.http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert probe.checksums()[0] == before, "the worker slept after /sleep had answered 504"
    assert probe.version() == version
    after = _completion(probe.http)
    assert after.status_code == 200, after.text
    assert "did not sleep" in resp.text, resp.text
    assert answered_first, (
        "/sleep answered only when the generation ended, not after its op timeout"
    )
    assert probe.http.get("/is_paused").json() == {"is_paused": False}


def test_sleep_edges_resume_round_and_pause(
    server: Server, probe: Probe, tiny_source: TensorSource
) -> None:
    """While asleep, /resume is a 503 naming /wake_up and a round's start a 409 naming the
    sleep; /sleep mid-round is a 409 naming the round; /wake_up keeps a trainer's
    /pause?mode=keep in place."""
    try:
        assert probe.http.post("/sleep", params={"level": 1}).status_code == 200
        resumed = probe.http.post("/resume")
        assert resumed.status_code == 503 and "POST /wake_up" in resumed.text, resumed.text
        engine = engine_for(
            server.url, tiny_source
        )  # an init is accepted: it does not touch the weights
        try:
            tiny_source.perturb(1)
            with pytest.raises(WeightSyncError) as info:
                engine.send_weights("asleep")
        finally:
            quiet_shutdown(engine)
        observe(resume=_error(resumed), round_while_asleep=info.value)
        assert (
            info.value.status == 409
            and "the server is asleep (/sleep level 1)" in info.value.message
        )
        assert "/wake_up?tags=weights" in info.value.message and "has [0]" not in info.value.message
        assert probe.http.post("/wake_up").json()["status"] == "awake"

        assert probe.http.post("/pause", params={"mode": "keep"}).status_code == 200
        assert probe.http.post("/sleep", params={"level": 1}).status_code == 200
        assert probe.http.post("/wake_up").json()["status"] == "awake"
        assert probe.http.get("/is_paused").json() == {"is_paused": True}, (
            "/wake_up lifted the trainer's pause"
        )
        assert probe.http.post("/resume").status_code == 200
        assert probe.http.get("/is_paused").json() == {"is_paused": False}

        engine = engine_for(server.url, tiny_source)
        try:
            assert probe.http.post("/start_weight_update").status_code == 200
            mid = probe.http.post("/sleep", params={"level": 1})
            observe(sleep_mid_round=_error(mid))
            assert mid.status_code == 409 and "round" in mid.text and "is active" in mid.text, (
                mid.text
            )
            assert probe.http.get("/is_sleeping").json() == {"is_sleeping": False}
        finally:
            probe.http.post("/finish_weight_update")  # closes the empty round
            quiet_shutdown(engine)
    finally:
        _awake(probe)


def test_level_2_refuses_generation_until_a_full_round(
    server: Server, probe: Probe, tiny_source: TensorSource
) -> None:
    """After /sleep?level=2 and /wake_up the weights are gone: /weight_info names no version,
    generation and /update_weight_version are refused naming the discarded weights, and a
    full round brings serving back under its version."""
    try:
        assert probe.http.post("/sleep", params={"level": 2}).status_code == 200
        assert probe.http.post("/wake_up").json()["status"] == "awake"
        info = probe.http.get("/weight_info").json()
        assert info["weight_version"] is None and info["sleep"]["discarded_tensors"] > 0, info
        refused = _completion(probe.http)
        observe(generation_after_level_2=_error(refused))
        assert refused.status_code == 503 and "discarded by /sleep?level=2" in refused.text, (
            refused.text
        )
        forged = probe.http.post("/update_weight_version", json={"new_version": "forged"})
        assert forged.status_code == 409 and "discarded" in forged.text, forged.text
        engine = engine_for(server.url, tiny_source)
        try:
            want = tiny_source.perturb(2)
            engine.send_weights("after-level-2")
        finally:
            quiet_shutdown(engine)
        assert_weights(probe, want, "after-level-2")
        assert _completion(probe.http).status_code == 200
        assert probe.http.get("/weight_info").json()["sleep"]["discarded_tensors"] == 0
    finally:
        _awake(probe)


def test_a_trainer_initialized_while_asleep_at_level_2_is_told_to_wake_the_weights(
    server: Server, probe: Probe, tiny_source: TensorSource
) -> None:
    """A trainer that initializes while the server sleeps at level 2 (its weights discarded,
    not woken): its round is refused by the server's start naming the sleep and the wake
    that ends it (was: the init told the served model's tensors as the empty placeholders
    the sleep left, so the trainer refused every round as "shape differs from the served
    model's ... (served: [0]): the source is not the served model's architecture"); after
    ``/wake_up`` the same engine's round commits and generation serves it."""
    try:
        assert probe.http.post("/sleep", params={"level": 2}).status_code == 200
        engine = engine_for(server.url, tiny_source)
        try:
            want = tiny_source.perturb(5)
            with pytest.raises(WeightSyncError, match="asleep") as refused:
                engine.send_weights("asleep")
            observe(refused=refused.value.message)
            assert refused.value.route == "start_weight_update"
            assert "/wake_up?tags=weights" in refused.value.message
            assert probe.http.post("/wake_up").json()["status"] == "awake"
            engine.send_weights("woken")
        finally:
            quiet_shutdown(engine)
        assert_weights(probe, want, "woken")
        assert _completion(probe.http).status_code == 200
    finally:
        _awake(probe)


def test_second_trainer_cannot_take_over_a_live_round(
    server: Server, probe: Probe, tiny_source: TensorSource
) -> None:
    """B's init while A's round is open and A still connected is refused (409 naming the
    round); once A's data link closes the round is stale, B's init drops it, and the drop is
    counted in rounds_failed and logged."""
    a_client = client_for(server.url)
    a = engine_for(server.url, tiny_source, client=a_client)
    b = None
    try:
        failed_before = probe.session()["rounds_failed"]
        session = a_client._sessions[0]
        assert (
            probe.http.post("/start_weight_update", headers={SESSION_HEADER: session}).status_code
            == 200
        )
        with elapsed() as t, pytest.raises(WeightSyncError) as info:
            quiet_shutdown(engine_for(server.url, TensorSource(tiny_source.tensors)))
        observe(second_trainer=info.value, second_trainer_s=t[0])
        assert info.value.status == 409 and "is in progress" in info.value.message, info.value
        state = probe.session()
        assert state["state"] == "round_active" and state["rounds_failed"] == failed_before, state

        # A's data link closes, A posts nothing: B's init must find the round stale and drop it
        # (A's own shutdown would drop it itself).
        a.session.close_link()
        b = _init_once_stale(server.url, tiny_source)
        state = probe.session()
        observe(server=state)
        assert state["state"] == "ready" and state["rounds_failed"] == failed_before + 1, state
        assert "dropped by a newer init" in server.log() and "closed the data link" in server.log()
        want = tiny_source.perturb(3)
        b.send_weights("b-after-drop")
        assert_weights(probe, want, "b-after-drop")
    finally:
        quiet_shutdown(a)
        if b is not None:
            quiet_shutdown(b)
        _awake(probe)


def _init_once_stale(url: str, source: TensorSource) -> Any:
    """B's init, retried while the server still sees A's link open (its close is in flight)."""
    for _ in range(50):
        try:
            return engine_for(url, source)
        except WeightSyncError as exc:
            if exc.status != 409 or "is in progress" not in exc.message:
                raise
        threading.Event().wait(0.1)
    raise AssertionError("B's init was still refused 5 s after A closed its link")


def test_update_weight_version_follows_rounds_and_sessions(
    server: Server, probe: Probe, tiny_source: TensorSource
) -> None:
    """/update_weight_version is refused (409) mid-round and from a session that is not the
    live one, and /weight_info keeps the real version; between rounds the live session (or a
    stock client without the header) may set it."""
    a_client = client_for(server.url)
    a = engine_for(server.url, tiny_source, client=a_client)
    try:
        a.send_weights("v-real")
        session = a_client._sessions[0]
        assert (
            probe.http.post("/start_weight_update", headers={SESSION_HEADER: session}).status_code
            == 200
        )
        mid = probe.http.post("/update_weight_version", json={"new_version": "forged-mid-round"})
        bogus = probe.http.post(
            "/update_weight_version",
            json={"new_version": "forged-bogus"},
            headers={SESSION_HEADER: "bogus-session"},
        )
        observe(mid_round=_error(mid), bogus_session=_error(bogus))
        assert mid.status_code == 409 and "round" in mid.text and "is active" in mid.text, mid.text
        assert bogus.status_code == 409 and "was replaced by a newer" in bogus.text, bogus.text
        assert probe.version() == "v-real"
        assert (
            probe.http.post("/finish_weight_update", headers={SESSION_HEADER: session}).status_code
            == 409
        )  # empty
        bogus = probe.http.post(
            "/update_weight_version",
            json={"new_version": "forged-bogus"},
            headers={SESSION_HEADER: "bogus-session"},
        )
        assert bogus.status_code == 409 and probe.version() == "v-real", bogus.text
        ok = probe.http.post(
            "/update_weight_version",
            json={"new_version": "v-named"},
            headers={SESSION_HEADER: session},
        )
        assert ok.status_code == 200 and probe.version() == "v-named", ok.text
    finally:
        quiet_shutdown(a)
        _awake(probe)


def test_every_round_is_logged(server: Server, probe: Probe, tiny_source: TensorSource) -> None:
    """At --log-level info the server logs each round's outcome: session, version, tensors,
    bytes, seconds; a failed round too."""
    engine = engine_for(server.url, tiny_source)
    try:
        tiny_source.perturb(4)
        engine.send_weights("logged")
    finally:
        quiet_shutdown(engine)
    n = len(tiny_source.tensors)
    line = next(
        (x for x in server.log().splitlines() if "committed: weight_version 'logged'" in x), None
    )
    observe(server=line)
    assert (
        line is not None and f"({n} tensors, " in line and " MB, " in line and line.endswith(" s)")
    ), line
    assert "of session #" in line
    engine = engine_for(server.url, tiny_source)
    try:
        assert probe.http.post("/start_weight_update").status_code == 200
        bad = probe.http.post("/update_weights", json={"update_info": {"names": 1}})
        assert bad.status_code == 422, bad.text
    finally:
        quiet_shutdown(engine)
    assert any(
        "failed, nothing committed: update_weights" in x for x in server.log().splitlines()
    ), server.log()
